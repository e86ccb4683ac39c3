"""Run a model on token ids and compare its outputs with a reference, array by array.

Outputs use the golden files' names (``<tag>_prefill_logits``, ``<tag>_topk_<layer>``,
``<tag>_candidates_<layer>``, ``<tag>_moe_topk``, ``b1_stream_after_layer``, ...), so one comparison
serves the reference implementation's dumps and our own runs. :func:`score` is ``dsv41 score``;
:func:`convert_and_score` adds the conversion in front of it (``infer/convert_and_score.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.engine.mesh import load_for_serving
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.model import Transformer
from dsv41_jax.model.indexer import block_mask
from dsv41_jax.model.moe import expert_parallel
from dsv41_jax.sharding import named_shardings, state_partition_specs


def score_inputs(model: Transformer, hasher: EngramHasher, inputs, mesh: jax.sharding.Mesh | None = None
                 ) -> dict[str, np.ndarray]:
    """Every ``<tag>_ids`` array of ``inputs`` (an npz) through :func:`prefill_outputs`, golden-named; per-layer
    detail for the first tag only, as the reference dumps. Raises ``ValueError`` when there is no such array."""
    tags = [k.removesuffix("_ids") for k in inputs.files if k.endswith("_ids")]
    if not tags:
        raise ValueError("no '<tag>_ids' arrays found")
    ours: dict[str, np.ndarray] = {}
    for tag in tags:
        ours |= prefill_outputs(model, hasher, inputs[f"{tag}_ids"], tag, layers_detail=tag == tags[0], mesh=mesh)
    return ours


def prefill_outputs(model: Transformer, hasher: EngramHasher, ids: np.ndarray, tag: str,
                    layers_detail: bool = False, mesh: jax.sharding.Mesh | None = None) -> dict[str, np.ndarray]:
    """Logits at every position and every discrete decision of a full-sequence forward (on ``mesh``: the
    weights sharded by the sharding table, MoE layers expert-parallel)."""
    cfg = model.cfg
    a = cfg.attention
    rows, _ = hasher.row_ids(np.asarray(ids, np.int64), None)
    graphdef, state = nnx.split(model)
    if mesh is not None:
        state = jax.device_put(state, named_shardings(mesh, state_partition_specs(state, mesh=mesh)))

    def forward(st, t, r):
        with expert_parallel(mesh):
            return nnx.merge(graphdef, st)(t, r, return_aux=True)

    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        logits, aux = jax.jit(forward)(state, jnp.asarray(ids), jnp.asarray(rows, jnp.int32))
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


class ScoreInputError(ValueError):
    """A token-id file that cannot be scored; the message names the file."""


def score(*, ckpt: str | os.PathLike | None = None, hf_dir: str | os.PathLike | None = None,
          inputs: str | os.PathLike | None = None, ids: str | os.PathLike | None = None,
          out: str | os.PathLike | None = None, reference: str | os.PathLike | None = None,
          dtype: str = "float32", param_dtype: str | None = None, as_json: bool = False, mesh: str | None = None
          ) -> dict[str, np.ndarray]:
    """Run an Orbax (``ckpt``) or release-format (``hf_dir``) checkpoint on token ids: ``dsv41 score``.

    ``inputs``: an npz of ``<tag>_ids`` arrays; every golden-named output (:func:`score_inputs`) is written to
    ``out`` and compared with ``reference`` where given. ``ids``: an npy of token ids [B, S]; the
    teacher-forced float32 logits [B, S, V] are written to ``out`` (default ``logits.npy``). Returns what it
    wrote; a file that cannot be scored is a :class:`ScoreInputError`.
    """
    if (inputs is None) == (ids is None):
        raise ValueError("score: give exactly one of inputs, ids")
    loaded, on = load_for_serving(mesh, ckpt=ckpt, hf_dir=hf_dir, dtype=dtype, param_dtype=param_dtype)
    model, hasher = loaded.model, loaded.hasher
    if ids is not None:
        tokens = np.load(ids)
        if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
            raise ScoreInputError(f"{ids}: expected integer token ids [B, S], got {tokens.dtype} {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= model.cfg.vocab_size:
            raise ScoreInputError(f"{ids}: token ids must lie in [0, {model.cfg.vocab_size})")
        logits = prefill_outputs(model, hasher, tokens, "ids", mesh=on)["ids_prefill_logits"]
        np.save(out or "logits.npy", logits)
        print(f"wrote logits {logits.shape} to {out or 'logits.npy'}")
        return {"logits": logits}
    try:
        ours = score_inputs(model, hasher, np.load(inputs), mesh=on)
    except ValueError as err:
        raise ScoreInputError(f"{inputs}: {err}") from None
    save_and_report(ours, out, reference, as_json)
    return ours


def convert_and_score(hf_dir: str | os.PathLike, ckpt: str | os.PathLike, *, weights: str = "fp32",
                      inputs: str | os.PathLike, out: str | os.PathLike | None = None,
                      reference: str | os.PathLike | None = None, dtype: str = "float32",
                      as_json: bool = False) -> dict[str, np.ndarray]:
    """``checkpoint.convert.convert`` of ``hf_dir`` into ``ckpt`` (a finished ``ckpt`` is kept as it is), then
    :func:`score` of the converted checkpoint on ``inputs``."""
    from dsv41_jax.checkpoint.convert import MANIFEST, convert, read_manifest

    ckpt = Path(ckpt)
    if (ckpt / MANIFEST).is_file():
        print(f"{ckpt} holds a finished conversion ({read_manifest(ckpt)['weights']} weights); scoring it")
    else:
        convert(hf_dir, ckpt, weights=weights)
    return score(ckpt=ckpt, inputs=inputs, out=out, reference=reference, dtype=dtype, as_json=as_json)
