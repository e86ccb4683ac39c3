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
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import cache as C
from dsv41_jax.checkpoint.load import load_drafter
from dsv41_jax.compile_cache import CompileNotice
from dsv41_jax.engine.mesh import load_for_serving
from dsv41_jax.engine.step import ChunkOptions, forward_chunk
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.model import Transformer
from dsv41_jax.model.dspark import DSpark, init_draft_cache
from dsv41_jax.model.indexer import block_mask
from dsv41_jax.model.moe import expert_parallel
from dsv41_jax.sharding import named_shardings, state_partition_specs

DECODE_ARRAYS = ("_decode_input_ids", "_decode_next_ids")


def score_inputs(model: Transformer, hasher: EngramHasher, inputs, mesh: jax.sharding.Mesh | None = None,
                 drafter: DSpark | None = None) -> dict[str, np.ndarray]:
    """Every ``<tag>_ids`` array of ``inputs`` (an npz) through :func:`prefill_outputs`, golden-named; per-layer
    detail for the first tag only, as the reference dumps. A tag that also has ``<tag>_decode_input_ids`` and
    ``<tag>_decode_next_ids`` runs the decode protocol too (:func:`decode_outputs`, with the ``drafter`` where
    given). Raises ``ValueError`` when there is no ``<tag>_ids`` array."""
    ours: dict[str, np.ndarray] = {}
    tags = input_tags(inputs.files)
    for tag, decode in tags.items():
        ours |= prefill_outputs(model, hasher, inputs[f"{tag}_ids"], tag, layers_detail=tag == next(iter(tags)),
                                mesh=mesh)
        if decode:
            ours |= decode_outputs(model, hasher, drafter, inputs[f"{tag}_ids"], *(inputs[k] for k in decode), tag)
    return ours


def input_tags(files: list[str]) -> dict[str, tuple[str, ...]]:
    """``{tag: decode-protocol arrays (none or both)}`` of every ``<tag>_ids`` array, in file order; a
    ``ValueError`` when there is none or a tag has only one of ``DECODE_ARRAYS``."""
    tags = {k.removesuffix("_ids"): () for k in files if k.endswith("_ids") and not k.endswith(DECODE_ARRAYS)}
    if not tags:
        raise ValueError("no '<tag>_ids' arrays found")
    for tag in tags:
        decode = tuple(f"{tag}{suffix}" for suffix in DECODE_ARRAYS)
        present = [k in files for k in decode]
        if any(present) and not all(present):
            raise ValueError(f"the decode protocol of {tag!r} needs both {decode[0]} and {decode[1]}")
        tags[tag] = decode if all(present) else ()
    return tags


def prefill_outputs(model: Transformer, hasher: EngramHasher, ids: np.ndarray, tag: str,
                    layers_detail: bool = False, mesh: jax.sharding.Mesh | None = None) -> dict[str, np.ndarray]:
    """Logits at every position and every discrete decision of a full-sequence forward (on ``mesh``: the
    weights sharded by the sharding table, MoE layers expert-parallel)."""
    a = model.cfg.attention
    rows, _ = hasher.row_ids(np.asarray(ids, np.int64), None)
    logits, aux = full_forward(model, ids, rows, mesh=mesh)
    out = {f"{tag}_prefill_logits": np.asarray(logits, np.float32), f"{tag}_engram_row_ids": rows}
    out |= {f"{tag}_{k}": v for k, v in decisions(model, aux, ids.shape[1]).items()}
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


def decode_outputs(model: Transformer, hasher: EngramHasher, drafter: DSpark | None, ids: np.ndarray,
                   decode_input_ids: np.ndarray, decode_next_ids: np.ndarray, tag: str,
                   prefill_chunk: int | None = None) -> dict[str, np.ndarray]:
    """The golden decode protocol (golden README §2, §6) through the engine's packed cache: prefill ``ids``
    from position 0 (in chunks of ``prefill_chunk`` tokens, default one chunk), then feed
    ``decode_input_ids[:, i]`` at position S+i, teacher-forced; after each step the drafter (when given) drafts
    with ``decode_next_ids[:, i]`` as the anchor. Golden-named arrays: ``<tag>_decode_logits`` /
    ``_decode_topk`` / ``_decode_engram_row_ids`` and ``<tag>_dspark_draft_ids`` / ``_dspark_logits`` /
    ``_dspark_confidence``."""
    cfg = model.cfg
    a = cfg.attention
    ids, fed, anchors = (np.asarray(x, np.int64) for x in (ids, decode_input_ids, decode_next_ids))
    if fed.ndim != 2 or fed.shape != anchors.shape or fed.shape[0] != ids.shape[0]:
        raise ValueError(f"{tag}: decode_input_ids {fed.shape} and decode_next_ids {anchors.shape} must both be "
                         f"[B, n] with B = {ids.shape[0]} as the prompt ids")
    b, s = ids.shape
    n = fed.shape[1]
    ratio = max((a.compress_ratios[layer] for layer in a.kv_source_layers), default=1)
    cache = C.init_cache(cfg, b, -(-(s + n) // ratio) * ratio)
    graphdef, state = nnx.split(model)
    dgraph, dstate = nnx.split(drafter) if drafter is not None else (None, None)
    options = ChunkOptions(return_selections=True, main_hidden=True)

    @jax.jit
    def step(state, dstate, cache, dcache, tokens, rows, n_new, anchor):
        m = nnx.merge(graphdef, state)
        logits, cache, sel, feats = forward_chunk(m, cache, tokens, rows, n_new, options=options)
        if dstate is None:
            return logits, cache, sel, dcache, None
        d = nnx.merge(dgraph, dstate)
        dcache = d.observe(dcache, feats.main_hidden, feats.pos, feats.valid)
        return logits, cache, sel, dcache, d.propose(m, dcache, anchor)

    rows, history = hasher.row_ids(ids)
    dcache = init_draft_cache(cfg, b) if drafter is not None else None
    chunk = prefill_chunk or s
    for lo in range(0, s, chunk):  # prefill: the drafts of these calls are not used
        k = min(chunk, s - lo)
        tokens, r = (jnp.asarray(_pad_rows(x[:, lo: lo + k], chunk), jnp.int32) for x in (ids, rows))
        _, cache, _, dcache, _ = step(state, dstate, cache, dcache, tokens, r, jnp.full((b,), k, jnp.int32),
                                      jnp.zeros((b,), jnp.int32))
    logits, topk, engram, drafts = [], [], [], []
    for i in range(n):
        r, history = hasher.row_ids(fed[:, i: i + 1], None, history)
        # padded to the prefill chunk: one compiled step serves prefill and decode
        width = chunk if prefill_chunk else 1
        tokens, rr = (jnp.asarray(_pad_rows(x, width), jnp.int32) for x in (fed[:, i: i + 1], r))
        lg, cache, sel, dcache, draft = step(state, dstate, cache, dcache, tokens, rr, jnp.ones((b,), jnp.int32),
                                             jnp.asarray(anchors[:, i], jnp.int32))
        logits.append(np.asarray(lg, np.float32))
        topk.append(np.stack([np.asarray(sel[layer])[:, 0] for layer in a.index_source_layers], 1))
        engram.append(r[:, 0])
        drafts.append(draft)
    out = {f"{tag}_decode_logits": np.stack(logits, 1), f"{tag}_decode_topk": np.stack(topk, 1).astype(np.int16),
           f"{tag}_decode_engram_row_ids": np.stack(engram, 1).astype(np.int64)}
    if drafter is not None:
        out[f"{tag}_dspark_draft_ids"] = np.stack([np.asarray(d.ids) for d in drafts], 1).astype(np.int64)
        out[f"{tag}_dspark_logits"] = np.stack([np.asarray(d.logits, np.float32) for d in drafts], 1)
        out[f"{tag}_dspark_confidence"] = np.stack([np.asarray(d.confidence, np.float32) for d in drafts], 1)
    return out


def _pad_rows(x: np.ndarray, length: int) -> np.ndarray:
    """``x`` [B, S, ...] zero-padded to ``length`` along S."""
    return np.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def full_forward(model: Transformer, ids: np.ndarray, rows: np.ndarray, *, is_image: np.ndarray | None = None,
                 image_embeds: jax.Array | None = None, mesh: jax.sharding.Mesh | None = None):
    """``(logits, aux)`` of the teacher-forced forward, compiled (on ``mesh``: sharded, MoE expert-parallel)."""
    graphdef, state = nnx.split(model)
    if mesh is not None:
        state = jax.device_put(state, named_shardings(mesh, state_partition_specs(state, mesh=mesh)))
        if image_embeds is not None:  # the tower ran on one device: the embeddings go to every device
            image_embeds = jax.device_put(image_embeds, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def forward(st, t, r, im, emb):
        with expert_parallel(mesh):
            return nnx.merge(graphdef, st)(t, r, im, image_embeds=emb, return_aux=True)

    im = None if is_image is None else jnp.asarray(is_image)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return jax.jit(forward)(state, jnp.asarray(ids), jnp.asarray(rows, jnp.int32), im, image_embeds)


def decisions(model: Transformer, aux, seq_len: int) -> dict[str, np.ndarray]:
    """Every discrete decision of a forward, golden-named without a tag: index top-k per index source,
    candidate blocks, MoE routes."""
    a = model.cfg.attention
    out = {f"topk_{layer}": np.asarray(aux.shared[layer].topk).astype(np.int16) for layer in a.index_source_layers}
    c = a.candidate_source_layer
    n_blocks = -(-(seq_len // a.compress_ratios[c]) // a.candidate_block_size)
    blocks = np.asarray(block_mask(aux.shared[c].candidates, n_blocks))  # kept block ids -> [B, S, blocks] mask
    out[f"candidates_{c}"] = np.repeat(blocks, a.candidate_block_size, -1)[..., :seq_len]
    out["moe_topk"] = np.stack(
        [np.asarray(r.experts).reshape(-1, r.experts.shape[-1]) for r in aux.routing]).astype(np.int8)
    return out


def image_inputs_outputs(model: Transformer, hasher: EngramHasher, encoder, inputs,
                         mesh: jax.sharding.Mesh | None = None) -> dict[str, np.ndarray]:
    """A text+image prefill of an inputs file holding ``input_ids``, ``token_types`` [B, S], ``row_images``
    [B, spans] and the images ``img{k}_rgb`` (uint8 [H, W, 3], run through our processor), with the vision
    golden's names: ``vit_out_{k}``, ``aligner_out_{k}``, ``embed_merged``, ``stream_after_layer{0,1,last}``,
    ``prefill_logits``, ``prefill_argmax_last``, ``engram_row_ids``, ``moe_topk``, ``topk_{layer}``.
    ``encoder`` is a :class:`dsv41_jax.vision.prompt.ImageEncoder`."""
    from dsv41_jax.vision.processor import process_image
    from dsv41_jax.vision.prompt import spans_of
    from dsv41_jax.vision.spans import Span

    ids, types = np.asarray(inputs["input_ids"], np.int64), np.asarray(inputs["token_types"], np.int64)
    which = np.asarray(inputs["row_images"], np.int64)
    if ids.shape != types.shape or ids.ndim != 2:
        raise ValueError(f"input_ids {ids.shape} and token_types {types.shape} must both be [B, S]")
    numbers = sorted(int(m[1]) for k in inputs.files if (m := re.fullmatch(r"img(\d+)_rgb", k)))
    if numbers != list(range(len(numbers))):
        raise ValueError(f"images must be numbered img0_rgb, img1_rgb, ... without gaps; found {numbers}")
    images = [process_image(np.asarray(inputs[f"img{k}_rgb"]), model.cfg.vision) for k in numbers]
    spans = []
    for b in range(ids.shape[0]):
        found = spans_of(types[b])
        if len(found) != which.shape[1]:
            raise ValueError(f"row {b} has {len(found)} image spans but row_images names {which.shape[1]}")
        spans.append([Span(st, n, int(k)) for (st, n), k in zip(found, which[b], strict=True)])
    encoded = [encoder.encode(im) for im in images]
    embeds = encoder.span_embeds(types, spans, encoded)
    is_image = types >= 0
    rows, _ = hasher.row_ids(ids, is_image)
    logits, aux = full_forward(model, ids, rows, is_image=is_image, image_embeds=embeds, mesh=mesh)
    out = {f"vit_out_{k}": np.asarray(e.vit, np.float32) for k, e in enumerate(encoded)}
    out |= {f"aligner_out_{k}": np.asarray(e.rows, np.float32) for k, e in enumerate(encoded)}
    out["embed_merged"] = np.asarray(model.embed_tokens(jnp.asarray(ids), jnp.asarray(is_image), embeds), np.float32)
    last = model.cfg.n_layers - 1
    out |= {f"stream_after_layer{i}": np.asarray(aux.streams[i], np.float32) for i in (0, 1, last)}
    out["prefill_logits"] = np.asarray(logits, np.float32)
    out["prefill_argmax_last"] = out["prefill_logits"][:, -1].argmax(-1)
    out["engram_row_ids"] = rows
    return out | decisions(model, aux, ids.shape[1])


IMAGE_INPUT_KEYS = ("input_ids", "token_types", "row_images")


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

    ``inputs``: an npz of ``<tag>_ids`` arrays (and, for the decode protocol and the DSpark drafts,
    ``<tag>_decode_input_ids`` / ``<tag>_decode_next_ids``); every golden-named output (:func:`score_inputs`) is
    written to ``out`` and compared with ``reference`` where given. An npz holding ``input_ids``,
    ``token_types``, ``row_images`` and ``img{k}_rgb`` images is a text+image prefill
    (:func:`image_inputs_outputs`). ``ids``: an npy of token ids [B, S]; the teacher-forced float32 logits
    [B, S, V] are written to ``out`` (default ``logits.npy``). Returns what it wrote; a file that cannot be
    scored is a :class:`ScoreInputError`.
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
        note = CompileNotice(f"the forward ({tokens.shape[0]} x {tokens.shape[1]} tokens)")
        logits = prefill_outputs(model, hasher, tokens, "ids", mesh=on)["ids_prefill_logits"]
        note.done()
        np.save(out or "logits.npy", logits)
        print(f"wrote logits {logits.shape} to {out or 'logits.npy'}")
        return {"logits": logits}
    arrays = np.load(inputs)
    drafter = None
    if any(k.endswith(DECODE_ARRAYS[0]) for k in arrays.files) and model.cfg.dspark.n_layers:
        drafter = load_drafter(model.cfg, ckpt=ckpt, hf_dir=hf_dir)
    note = CompileNotice(f"the forwards of {inputs}")
    try:
        if all(k in arrays.files for k in IMAGE_INPUT_KEYS):
            from dsv41_jax.checkpoint.load import vision_encoder
            from dsv41_jax.vision.prompt import ImageEncoder

            encoder = ImageEncoder(vision_encoder(ckpt=ckpt, hf_dir=hf_dir, dtype=dtype, param_dtype=param_dtype))
            ours = image_inputs_outputs(model, hasher, encoder, arrays, mesh=on)
        else:
            ours = score_inputs(model, hasher, arrays, mesh=on, drafter=drafter)
    except ValueError as err:
        raise ScoreInputError(f"{inputs}: {err}") from None
    note.done()
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
