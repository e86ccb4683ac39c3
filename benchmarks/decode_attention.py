"""Time one decode step of the sparse attention at the release geometry (64 heads × 512, a 128-slot window
ring, 512 compressed picks, sink). Prints one JSON line. Usage: python benchmarks/decode_attention.py [batch]"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model.sparse import sparse_attention

b = int(sys.argv[1]) if len(sys.argv) > 1 else 32
n, h, w, k, ctx = 64, 512, 128, 512, 4096
key = jax.random.key(0)
args = dict(q=jax.random.normal(key, (b, 1, n, h), jnp.bfloat16), kv=jax.random.normal(key, (b, 1, h), jnp.bfloat16),
            ring=jax.random.normal(key, (b, w, h), jnp.bfloat16),
            picked=jax.random.normal(key, (b, 1, k, h), jnp.bfloat16),
            topk=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, 1, k)), start=jnp.full((b,), ctx),
            ring_pos=jnp.broadcast_to(ctx - w + jnp.arange(w), (b, w)))
fn = jax.jit(lambda a: sparse_attention(a["q"], a["kv"], jnp.zeros((n,)), w, topk=a["topk"], picked=a["picked"],
                                        start=a["start"], prefix_kv=a["ring"], prefix_pos=a["ring_pos"]))
jax.block_until_ready(fn(args))
times = []
for _ in range(5):
    t = time.perf_counter()
    jax.block_until_ready(fn(args))
    times.append(time.perf_counter() - t)
print(json.dumps({"bench": "decode_attention", "device": str(jax.devices()[0]), "jax": jax.__version__,
                  "batch": b, "ms": 1e3 * float(np.median(times))}))
