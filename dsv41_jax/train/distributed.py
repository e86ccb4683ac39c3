"""Multi-host start-up: ``jax.distributed`` from the run config's ``distributed:`` section or the environment.

Each key is taken from the config first, then from the environment, our name before JAX's:

| key | environment |
|---|---|
| ``coordinator_address`` | ``DSV41_COORDINATOR``, ``JAX_COORDINATOR_ADDRESS`` |
| ``num_processes`` | ``DSV41_NUM_PROCESSES``, ``JAX_NUM_PROCESSES`` |
| ``process_id`` | ``DSV41_PROCESS_ID``, ``JAX_PROCESS_ID`` |

Nothing set anywhere (and ``auto_detect`` off) means one process: JAX is not initialised. With a coordinator
or more than one process, all three must be known unless ``auto_detect`` lets JAX read them from the cluster
(SLURM, Open MPI, Cloud TPU, Kubernetes). This must run before anything touches a device, so ``dsv41 train``
calls it right after reading the config. On CPU the processes talk through gloo collectives.

After initialisation ``jax.devices()`` lists every process's devices, the mesh spans them all, each process
reads its own documents (``process_index`` / ``process_count`` in the pipeline) and the global batch is
assembled with ``jax.make_array_from_process_local_data``; only process 0 writes logs and metrics.
"""

from __future__ import annotations

import os

import jax

from dsv41_jax.config import ConfigError
from dsv41_jax.train.config import DistributedConfig

ENV = {
    "coordinator_address": ("DSV41_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("DSV41_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("DSV41_PROCESS_ID", "JAX_PROCESS_ID"),
}


def resolve(cfg: DistributedConfig, environ: dict | None = None) -> dict:
    """The three keys after the environment fallbacks (``None`` where unset); bad values name the variable."""
    environ = os.environ if environ is None else environ
    out: dict = {}
    for key, names in ENV.items():
        value = getattr(cfg, key)
        if value is None:
            for name in names:
                raw = environ.get(name)
                if raw:
                    if key == "coordinator_address":
                        value = raw
                    else:
                        try:
                            value = int(raw)
                        except ValueError:
                            raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None
                    break
        out[key] = value
    return out


def initialize(cfg: DistributedConfig, log=print) -> bool:
    """Start ``jax.distributed`` when the config or environment asks for it; True if it did.

    Must run before the first device use: a backend that is already up is an error that says so.
    """
    keys = resolve(cfg)
    wanted = cfg.auto_detect or keys["coordinator_address"] is not None or (keys["num_processes"] or 1) > 1
    if not wanted:
        return False
    missing = [k for k, v in keys.items() if v is None]
    if missing and not cfg.auto_detect:
        raise ConfigError(f"distributed: {', '.join(missing)} not set (config key distributed.<key> or "
                          f"{' / '.join(ENV[missing[0]])}); set all three, or distributed.auto_detect: true")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise ConfigError("distributed: JAX devices were used before jax.distributed could start; initialise "
                          "first (dsv41 train does so before building anything)")
    jax.distributed.initialize(keys["coordinator_address"], keys["num_processes"], keys["process_id"],
                               initialization_timeout=cfg.timeout_s)
    if jax.process_index() == 0:
        log(f"jax.distributed: {jax.process_count()} processes, coordinator {keys['coordinator_address']}, "
            f"{jax.device_count()} devices ({jax.local_device_count()} here)")
    return True
