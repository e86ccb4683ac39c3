"""XLA reference of the kernels' form of sparse MQA: every query attends to its own list of key rows.

The model's attention (spec attention §3.6: window keys, the store's window prefix, the selected compressed
entries and the per-head sink in one softmax) is :func:`dsv41_jax.model.sparse.sparse_attention`; ``layout``
rewrites its arguments into this form: key arrays ``main`` [B, T, H] and ``extra`` [B, E, H] and a row list
``idx`` [B, S, L] per query into ``main ++ extra`` (−1 = no key). :func:`sparse_mqa` is that form computed
in XLA, the semantics the Mosaic kernels implement: logits and the denominator in fp32, probabilities cast
to the activation dtype before P·V, the sink only in the denominator. It also returns the log-sum-exp over
keys and sink that the backward pass reuses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from dsv41_jax.model.sparse import gather_entries


def sparse_mqa(
    q: Float[Array, "B S N H"],
    main: Float[Array, "B T H"],
    extra: Float[Array, "B E H"],
    idx: Int[Array, "B S L"],
    sink: Float[Array | np.ndarray, "N"],
    scale: float,
) -> tuple[Float[Array, "B S N H"], Float[Array, "B S N"]]:
    """``(out, lse)``: attention of each query's heads to the rows ``(main ++ extra)[b, idx[b, s, l]]`` (−1
    skipped), K = V."""
    dt = q.dtype
    kv = jnp.concatenate([main, extra], axis=1).astype(dt)
    keys = gather_entries(kv, jnp.maximum(idx, 0))  # [B, S, L, H]
    logits = jnp.einsum("bsnh,bslh->bsnl", q, keys, preferred_element_type=jnp.float32) * scale
    logits = jnp.where((idx >= 0)[:, :, None, :], logits, -jnp.inf)
    sink = sink.astype(jnp.float32)[None, None, :]  # [1, 1, N]
    mx = jax.lax.stop_gradient(jnp.maximum(sink, logits.max(-1)))  # [B, S, N]
    p = jnp.exp(logits - mx[..., None])
    den = jnp.exp(sink - mx) + p.sum(-1)
    out = jnp.einsum("bsnl,bslh->bsnh", p.astype(dt), keys, preferred_element_type=jnp.float32)
    return (out / den[..., None]).astype(dt), mx + jnp.log(den)
