"""``--mesh`` of the serving commands (``dsv41 sample``, ``dsv41 score``): the mesh, and the model restored
straight into its shards.

A converted (Orbax) checkpoint is read shard by shard onto the devices the sharding table assigns
(``checkpoint.load.model_from_orbax(mesh=...)``): no host ever holds the whole model. A release-format directory
or a run is loaded on one device first and then placed: convert the release before serving it on many devices.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from dsv41_jax.checkpoint.load import Loaded, load_model, model_from_orbax
from dsv41_jax.config import ConfigError, ModelConfig

AXES = ("data", "fsdp", "expert", "tensor")  # dsv41_jax.sharding


def parse_mesh(text: str | None, n_experts: int | None = None, n_devices: int | None = None
               ) -> tuple[int, ...] | None:
    """``"expert=8"`` / ``"data=2,expert=4"`` -> axis sizes in ``AXES`` order (absent axes 1); ``"auto"`` puts
    every device on ``expert`` when the routed experts divide over them, else on ``data``. None: no mesh."""
    if not text:
        return None
    n = n_devices or jax.device_count()
    if text == "auto":
        axis = "expert" if n_experts is None or n_experts % n == 0 else "data"
        return tuple(n if a == axis else 1 for a in AXES)
    sizes = dict.fromkeys(AXES, 1)
    for part in text.split(","):
        key, _, value = (s.strip() for s in part.partition("="))
        if key not in sizes or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--mesh {text!r}: expected auto or AXIS=SIZE[,AXIS=SIZE...] with AXIS in {AXES}")
        sizes[key] = int(value)
    total = 1
    for v in sizes.values():
        total *= v
    if total != n:
        raise ConfigError(f"--mesh {text!r}: {total} devices, but {n} are present (JAX_PLATFORMS / "
                          "XLA_FLAGS decide how many)")
    return tuple(sizes.values())


def serving_mesh(text: str | None, cfg: ModelConfig | None = None) -> jax.sharding.Mesh | None:
    shape = parse_mesh(text, cfg.moe.n_routed_experts if cfg is not None else None)
    if shape is None:
        return None
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def load_for_serving(mesh_text: str | None, *, run: str | os.PathLike | None = None,
                     ckpt: str | os.PathLike | None = None, hf_dir: str | os.PathLike | None = None,
                     dtype: str = "float32", param_dtype: str | None = None, log=print
                     ) -> tuple[Loaded, jax.sharding.Mesh | None]:
    """:func:`load_model`, with ``--mesh``: a converted checkpoint restored into its shards on that mesh."""
    if mesh_text and ckpt is not None:
        from dsv41_jax import config as C

        mesh = serving_mesh(mesh_text, C.from_hf(Path(ckpt) / "config.json"))
        model, hasher = model_from_orbax(ckpt, dtype=dtype, param_dtype=param_dtype, mesh=mesh)
        return Loaded(model, hasher, Path(ckpt) / "tokenizer.json"), mesh
    loaded = load_model(run=run, ckpt=ckpt, hf_dir=hf_dir, dtype=dtype, param_dtype=param_dtype, log=log)
    return loaded, serving_mesh(mesh_text, loaded.model.cfg)
