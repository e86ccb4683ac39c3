"""Run in a subprocess with 8 fake CPU devices: a decode step with model and cache sharded over a mesh
equals the single-device step. Prints one JSON line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from dsv41_jax import cache as C
from dsv41_jax import config
from dsv41_jax.engine import forward_chunk
from dsv41_jax.model import Transformer
from dsv41_jax.sharding import state_partition_specs

cfg = config.tiny().replace(dtype="float32")
model = Transformer(cfg, rngs=nnx.Rngs(0))
graphdef, state = nnx.split(model)
rng = np.random.default_rng(0)
b, s = 4, 24
tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s)), jnp.int32)
rows = jnp.asarray(np.stack([rng.integers(0, n, (b, s, cfg.engram.n_columns)) for n in cfg.engram.num_embeddings],
                            axis=2), jnp.int32)


def step(state, cache, t, r):
    n = jnp.full((t.shape[0],), t.shape[1], jnp.int32)
    return forward_chunk(nnx.merge(graphdef, state), cache, t, r, n)


def run(state, cache):
    fn = jax.jit(step)
    logits, cache = fn(state, cache, tokens[:, :16], rows[:, :16])  # prefill
    out = [logits]
    for i in range(16, s):  # decode
        logits, cache = fn(state, cache, tokens[:, i:i + 1], rows[:, i:i + 1])
        out.append(logits)
    return np.stack([np.asarray(x) for x in out]), cache


single, _ = run(state, C.init_cache(cfg, b, 64))
mesh = jax.make_mesh((2, 2, 2, 1), ("data", "fsdp", "expert", "tensor"),
                     axis_types=(jax.sharding.AxisType.Auto,) * 4)
specs = dict(nnx.to_flat_state(state_partition_specs(state, mesh=mesh)))
sharded_state = nnx.from_flat_state([
    (path, var.replace(jax.device_put(var.get_value(), NamedSharding(mesh, specs[path]))))
    for path, var in nnx.to_flat_state(state)])
cache = C.init_cache(cfg, b, 64)
sharded_cache = jax.tree.map(lambda x, p: jax.device_put(x, NamedSharding(mesh, p)), cache,
                             C.cache_partition_specs(cache, mesh, sequence_axis="fsdp"))
with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
    sharded, out_cache = run(sharded_state, sharded_cache)
rel = np.linalg.norm(sharded - single, axis=-1) / np.linalg.norm(single, axis=-1)  # per logits row
print(json.dumps({"max_abs_diff": float(np.abs(sharded - single).max()), "median_row_rel": float(np.median(rel)),
                  "max_row_rel": float(rel.max()),
                  "cache_sharding": str(out_cache.sources[0].kv_codes.sharding.spec),
                  "n_devices": len(out_cache.sources[0].kv_codes.sharding.device_set)}))
