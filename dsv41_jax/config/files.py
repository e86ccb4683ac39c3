"""The YAML configs that ship with the library (``configs/`` of the repository, installed as
``dsv41_jax/configs/``), found by name or by their repository path from any working directory."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parents[1]  # dsv41_jax/
# an installed wheel holds them inside the package; a source checkout (editable install) beside it
CONFIGS = next((d for d in (_HERE / "configs", _HERE.parent / "configs") if d.is_dir()), _HERE / "configs")


def packaged_configs() -> list[str]:
    """Names of the shipped configs, e.g. ``pretrain_tiny``."""
    return sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def config_path(spec: str) -> Path:
    """``spec`` itself when that file exists; else the shipped config it names (``pretrain_tiny``,
    ``pretrain_tiny.yaml`` or ``configs/pretrain_tiny.yaml``, as the README writes it); else ``spec``, for the
    caller's own "no such file" error."""
    path = Path(spec)
    if path.exists():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    if path.parent in (Path("."), Path("configs")) and (CONFIGS / name).is_file():
        return CONFIGS / name
    return path
