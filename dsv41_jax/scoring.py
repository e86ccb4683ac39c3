"""Run a model on token ids and compare its outputs with a reference, array by array.

Outputs use the golden files' names (``<tag>_prefill_logits``, ``<tag>_topk_<layer>``,
``<tag>_candidates_<layer>``, ``<tag>_moe_topk``, ``b1_stream_after_layer``, ...), so one comparison
serves the reference implementation's dumps and our own runs.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.model import Transformer
from dsv41_jax.model.indexer import block_mask


def score_inputs(model: Transformer, hasher: EngramHasher, inputs) -> dict[str, np.ndarray]:
    """Every ``<tag>_ids`` array of ``inputs`` (an npz) through :func:`prefill_outputs`, golden-named; per-layer
    detail for the first tag only, as the reference dumps. Raises ``ValueError`` when there is no such array."""
    tags = [k.removesuffix("_ids") for k in inputs.files if k.endswith("_ids")]
    if not tags:
        raise ValueError("no '<tag>_ids' arrays found")
    ours: dict[str, np.ndarray] = {}
    for tag in tags:
        ours |= prefill_outputs(model, hasher, inputs[f"{tag}_ids"], tag, layers_detail=tag == tags[0])
    return ours


def prefill_outputs(model: Transformer, hasher: EngramHasher, ids: np.ndarray, tag: str,
                    layers_detail: bool = False) -> dict[str, np.ndarray]:
    """Logits at every position and every discrete decision of a full-sequence forward."""
    cfg = model.cfg
    a = cfg.attention
    rows, _ = hasher.row_ids(np.asarray(ids, np.int64), None)
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, t, r: nnx.merge(graphdef, st)(t, r, return_aux=True))
    logits, aux = fwd(state, jnp.asarray(ids), jnp.asarray(rows, jnp.int32))
    out = {f"{tag}_prefill_logits": np.asarray(logits, np.float32), f"{tag}_engram_row_ids": rows}
    for layer in a.index_source_layers:
        out[f"{tag}_topk_{layer}"] = np.asarray(aux.shared[layer].topk).astype(np.int16)
    c = a.candidate_source_layer
    n_blocks = -(-(ids.shape[1] // a.compress_ratios[c]) // a.candidate_block_size)
    blocks = np.asarray(block_mask(aux.shared[c].candidates, n_blocks))  # kept block ids -> [B, S, blocks] mask
    out[f"{tag}_candidates_{c}"] = np.repeat(blocks, a.candidate_block_size, -1)[..., : ids.shape[1]]
    out[f"{tag}_moe_topk"] = np.stack(
        [np.asarray(r.experts).reshape(-1, r.experts.shape[-1]) for r in aux.routing]).astype(np.int8)
    if layers_detail:  # first sequence only, as the reference dumps do
        p = "b1" if tag == "batch1" else tag
        out[f"{p}_stream_after_layer"] = np.stack([np.asarray(s[0], np.float32) for s in aux.streams])
        out[f"{p}_pre_mix_after_layer"] = np.stack([np.asarray(s[0]) for s in aux.pre])
        if aux.main_hidden is not None:
            out[f"{p}_main_hidden"] = np.asarray(aux.main_hidden[0], np.float32)
        for layer in a.kv_source_layers:
            out[f"{p}_compressed_kv_{layer}"] = np.asarray(aux.shared[layer].kv.main[0], np.float32)
            out[f"{p}_index_k_{layer}"] = np.asarray(aux.shared[layer].kv.index[0], np.float32)
    return out


def row_rel_l2(a: np.ndarray, ref: np.ndarray) -> np.ndarray:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return (np.linalg.norm(a - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)).ravel()


def compare(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per shared array: relative-L2 statistics per row (floats) or row agreement (integers/bools)."""
    report = {}
    for key in sorted(set(ours) & set(ref)):
        a, b = np.asarray(ours[key]), np.asarray(ref[key])
        if a.shape != b.shape:
            report[key] = {"error": f"shape {a.shape} vs reference {b.shape}"}
        elif b.dtype.kind == "f":
            e = row_rel_l2(a, b)
            report[key] = {"median": float(np.median(e)), "q90": float(np.quantile(e, 0.9)), "max": float(e.max())}
            if key.endswith("logits"):
                report[key]["argmax_agreement"] = float((a.argmax(-1) == b.argmax(-1)).mean())
        else:
            same = np.sort(a, -1) == np.sort(b, -1) if "topk" in key else a == b
            report[key] = {"row_agreement": float(same.reshape(-1, a.shape[-1]).all(-1).mean())}
    return report


def format_report(report: dict[str, dict]) -> str:
    lines = []
    for key, r in report.items():
        stats = "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
        lines.append(f"{key:32s} {stats}")
    return "\n".join(lines)


def save_and_report(ours: dict[str, np.ndarray], out: str | None, reference: str | None, as_json: bool) -> None:
    """Write ``ours`` to ``out`` (.npz) and print its comparison with the ``reference`` .npz, where given."""
    if out:
        np.savez(out, **ours)
        print(f"wrote {len(ours)} arrays to {out}")
    if reference:
        report = compare(ours, dict(np.load(reference)))
        print(json.dumps(report, indent=1) if as_json else format_report(report))
