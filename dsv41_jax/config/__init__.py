"""Model configuration: frozen dataclasses (:mod:`.schema`), strict YAML and HF ``config.json`` loaders
(:mod:`.loaders`) and named presets (:mod:`.presets`).

``from_dict`` / ``load_yaml`` read our nested format (``preset: name`` picks the base the other keys
override); ``from_hf`` / ``to_hf_json`` read and write the release's ``config.json``. ``fail``,
``check_type`` and ``build_dataclass`` are the strict-construction helpers the run configs (train, optim,
posttrain) build on, so that every config error names its key and file the same way.
"""

from dsv41_jax.config.loaders import (
    build_dataclass,
    check_type,
    from_dict,
    from_hf,
    load_yaml,
    parse_value,
    read_yaml,
    to_dict,
    to_hf,
    to_hf_json,
)
from dsv41_jax.config.presets import PRESETS, get_preset, tiny, v41_flash
from dsv41_jax.config.schema import (
    KERNEL_BACKENDS,
    AttentionConfig,
    CacheQuant,
    ConfigError,
    DSparkConfig,
    EngramConfig,
    MHCConfig,
    ModelConfig,
    MoEConfig,
    VisionConfig,
    fail,
    validate,
)

__all__ = [
    "KERNEL_BACKENDS", "PRESETS", "AttentionConfig", "CacheQuant", "ConfigError", "DSparkConfig",
    "EngramConfig", "MHCConfig", "ModelConfig", "MoEConfig", "VisionConfig", "build_dataclass", "check_type",
    "fail", "from_dict", "from_hf", "get_preset", "load_yaml", "parse_value",
    "read_yaml", "tiny", "to_dict", "to_hf",
    "to_hf_json", "v41_flash", "validate",
]
