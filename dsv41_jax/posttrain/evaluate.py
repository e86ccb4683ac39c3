"""The served-vs-exact gap (``dsv41 eval-served``): how far serving moves a model's response predictions.

(a) **exact**: the training forward with every fake-quant switch off, in fp32, over prompt + response.
(b) **served**: the engine over its packed cache: the prompt's prefix ``[0, h)`` prefilled, then
    ``replay_after_hit`` at ``h`` with CED options (encoder bounded replay, decoder bounded replay at the
    prompt end, FP4 / MXFP4 / FP8 caches), then the response fed as one teacher-forced chunk (a chunk equals
    token-by-token decoding, tests/engine). A ``cold`` boundary is a prefill without a hit; the engine path
    runs it as a hit at ``h = window``, which truncates nothing and reuses exactly what a cold prefill writes.
Ablations apply one approximation at a time through the served-path simulation of :mod:`.replay` (the same
numerics as the engine, ``tests/posttrain``), since the packed cache always holds all three formats.

Per response token (rows ``N−1 … len−2`` predict the response and ``<eos>``): NLL difference (b − a),
next-token agreement (argmax a == argmax b) and KL(a‖b).

On a mesh (``--mesh``) the weights sit where the sharding table puts them (a run's or a converted checkpoint's
restored straight into their shards), MoE layers run expert-parallel and the engine's cache is split over the
batch as the generator splits it; every path is the same computation, only sums are ordered differently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import cache as C
from dsv41_jax.config import CacheQuant
from dsv41_jax.engine.prefill import check_ced_cut, default_ced_cut, replay_after_hit
from dsv41_jax.engine.sampling import SERVE_BATCH
from dsv41_jax.engine.step import ChunkOptions, forward_chunk
from dsv41_jax.model.moe import expert_parallel
from dsv41_jax.model.transformer import Transformer, abstract_model
from dsv41_jax.posttrain.replay import ServePlan, served_forward
from dsv41_jax.sharding import named_shardings, state_partition_specs

APPROXIMATIONS = ("main_kv", "index", "swa", "ced", "replay")
QUANT = ("main_kv", "index", "swa")


class EvalBatch(NamedTuple):
    """Conversations padded to one length: tokens [B, L], Engram rows [B, L, n, C] (or None), prompt length N
    and total length per row (prompt + response + ``<eos>``)."""

    tokens: np.ndarray
    engram_rows: np.ndarray | None
    prompt_len: np.ndarray
    length: np.ndarray


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    on: frozenset[str]  # approximations applied (subset of APPROXIMATIONS)
    engine: bool = False  # computed by the engine's packed cache (all of them on)


def settings(ablations: bool) -> list[Setting]:
    """``served`` (the engine), and with ``ablations``: nothing on (must match exact), each one alone, all."""
    out = [Setting("served", frozenset(APPROXIMATIONS), engine=True)]
    if ablations:
        out += [Setting("none", frozenset())] + [Setting(a, frozenset({a})) for a in APPROXIMATIONS]
        out += [Setting("all (sim)", frozenset(APPROXIMATIONS))]
    return out


def with_quant(model: Transformer, quant: CacheQuant) -> Transformer:
    """The same parameters under other fake-quant switches (the switches are static config)."""
    cfg = model.cfg.replace(attention=dataclasses.replace(model.cfg.attention, cache_quant=quant))
    if cfg == model.cfg:
        return model
    graphdef = nnx.split(abstract_model(cfg))[0]
    return nnx.merge(graphdef, nnx.state(model))


def on_mesh(model: Transformer, mesh: jax.sharding.Mesh | None) -> Transformer:
    """``model`` with every variable placed by the sharding table on ``mesh`` (a no-op where it already is)."""
    if mesh is None:
        return model
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, named_shardings(mesh, state_partition_specs(state, mesh=mesh))))


def _mesh_of(model: Transformer) -> jax.sharding.Mesh | None:
    """The mesh ``model``'s weights are placed on (:func:`on_mesh`), or None on one device."""
    sharding = jax.tree.leaves(nnx.state(model))[0].sharding
    return sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None


# ----------------------------------------------------------------------------------------------------
# the paths (jitted once per model structure, shape and mesh)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"))
def _exact(graphdef, state, tokens, rows, mesh):
    with expert_parallel(mesh):
        return nnx.merge(graphdef, state)(tokens, rows)


@functools.partial(jax.jit, static_argnames=("graphdef", "cut", "mesh"))
def _sim(graphdef, state, tokens, rows, hit, prompt_len, cut, mesh):
    with expert_parallel(mesh):
        return served_forward(nnx.merge(graphdef, state), tokens, rows, ServePlan(hit, prompt_len), cut=cut)[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"))
def _chunk(graphdef, state, cache, tokens, rows, n_new, mesh):
    with expert_parallel(mesh):
        return forward_chunk(nnx.merge(graphdef, state), cache, tokens, rows, n_new,
                             options=ChunkOptions(all_logits=True))


@functools.partial(jax.jit, static_argnames=("graphdef", "cut", "mesh"))
def _replay(graphdef, state, cache, tokens, rows, hit, n_new, cut, mesh):
    with expert_parallel(mesh):
        return replay_after_hit(nnx.merge(graphdef, state), cache, tokens, rows, hit, n_new,
                                options=ChunkOptions(ced_cut=cut, all_logits=True))


def _within(mesh: jax.sharding.Mesh | None):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _rows(x):
    return None if x is None else jnp.asarray(x, jnp.int32)


def exact_logits(model: Transformer, batch: EvalBatch) -> jax.Array:
    """(a) fp32 logits [B, L, V] of the training forward (under ``model``'s own switches)."""
    graphdef, state = nnx.split(model)
    mesh = _mesh_of(model)
    with _within(mesh):
        return _exact(graphdef, state, jnp.asarray(batch.tokens), _rows(batch.engram_rows), mesh)


def sim_logits(model: Transformer, batch: EvalBatch, hit: np.ndarray, cut: int | None) -> jax.Array:
    """Logits [B, L, V] of the served-path simulation (``hit`` 0 = cold; ``cut`` None = no CED)."""
    graphdef, state = nnx.split(model)
    mesh = _mesh_of(model)
    with _within(mesh):
        return _sim(graphdef, state, jnp.asarray(batch.tokens), _rows(batch.engram_rows),
                    jnp.asarray(hit, jnp.int32), jnp.asarray(batch.prompt_len, jnp.int32), cut, mesh)


def _shift(x: np.ndarray | None, start: np.ndarray) -> np.ndarray | None:
    """Each row of ``x`` [B, L, ...] moved left to begin at ``start[b]`` (zero-padded on the right)."""
    if x is None:
        return None
    out = np.zeros_like(x)
    for b, s in enumerate(start):
        out[b, : x.shape[1] - s] = x[b, s:]
    return out


def engine_logits(model: Transformer, batch: EvalBatch, hit: np.ndarray, cut: int) -> np.ndarray:
    """(b) logits [B, L, V] from the engine: prefix prefill, ``replay_after_hit`` at ``hit`` (≥ window) with CED
    at ``cut``, then the response as one chunk. Only rows ``N−1 … len−2`` are filled (the rest are 0)."""
    w = model.cfg.attention.window_size
    hit, n = np.asarray(hit), np.asarray(batch.prompt_len)
    if (hit < w).any() or (hit > n).any():
        raise ValueError(f"engine hits must lie in [window={w}, prompt_len]: {hit.tolist()} vs {n.tolist()}")
    b, s = batch.tokens.shape
    if s <= w:
        raise ValueError(f"pad the batch beyond the window ({w}) so that CED narrows the decoder rows")
    graphdef, state = nnx.split(model)
    mesh = _mesh_of(model)
    cap = -(-s // 2) * 2 + 2
    cache = C.init_cache(model.cfg, b, cap)
    if mesh is not None:  # rows split over the mesh as the generator splits its sequences
        cache = jax.device_put(cache, named_shardings(mesh, C.cache_partition_specs(cache, mesh,
                                                                                    batch_axis=SERVE_BATCH)))
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # one placement for every call: no recompiles on a mesh
    with _within(mesh):
        _, cache = _chunk(graphdef, state, cache, jnp.asarray(batch.tokens), _rows(batch.engram_rows), i32(hit),
                          mesh)
        start = hit - w
        last, cache = _replay(graphdef, state, cache, jnp.asarray(_shift(batch.tokens, start)),
                              _rows(_shift(batch.engram_rows, start)), i32(hit), i32(n - start), cut, mesh)
        resp, _ = _chunk(graphdef, state, cache, jnp.asarray(_shift(batch.tokens, n)),
                         _rows(_shift(batch.engram_rows, n)), i32(batch.length - n), mesh)
    last, resp = np.asarray(last), np.asarray(resp)  # [B, W, V] (CED keeps the last W prompt rows), [B, L, V]
    out = np.zeros((b, s, last.shape[-1]), np.float32)
    for i in range(b):
        out[i, n[i] - 1] = last[i, -1]
        k = max(int(batch.length[i] - n[i]) - 1, 0)  # padding rows have no response
        out[i, n[i]: n[i] + k] = resp[i, :k]
    return out


# ----------------------------------------------------------------------------------------------------
# metrics and the driver


def response_mask(batch: EvalBatch) -> np.ndarray:
    """bool [B, L]: row t predicts a response token (N−1 ≤ t < len − 1)."""
    t = np.arange(batch.tokens.shape[1])[None]
    return (t >= batch.prompt_len[:, None] - 1) & (t < batch.length[:, None] - 1)


@jax.jit
def _token_stats(a, b, targets):  # on a mesh: wherever a and b are
    la, lb = jax.nn.log_softmax(a), jax.nn.log_softmax(b)
    nll_a = -jnp.take_along_axis(la, targets[..., None], -1)[..., 0]
    nll_b = -jnp.take_along_axis(lb, targets[..., None], -1)[..., 0]
    kl = jnp.sum(jnp.exp(la) * (la - lb), axis=-1)
    return nll_a, nll_b, jnp.argmax(a, -1) == jnp.argmax(b, -1), kl


def gap_metrics(a, b, batch: EvalBatch, mask: np.ndarray) -> dict:
    """Sums over the tokens of ``mask``: count, NLL of a and b, agreements, KL(a‖b)."""
    targets = np.concatenate([batch.tokens[:, 1:], np.zeros_like(batch.tokens[:, :1])], axis=1)
    nll_a, nll_b, agree, kl = (np.asarray(x, np.float64) for x in _token_stats(a, b, jnp.asarray(targets)))
    return {"tokens": int(mask.sum()), "nll_exact": float(nll_a[mask].sum()), "nll_served": float(nll_b[mask].sum()),
            "agree": float(agree[mask].sum()), "kl": float(kl[mask].sum()),
            "dnll_max": float(np.abs(nll_b - nll_a)[mask].max(initial=0.0))}


def _hits(batch: EvalBatch, boundary: int | None, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(hit per row, rows where the boundary applies): a hit must lie in [window, N)."""
    n = batch.prompt_len
    if boundary is None:
        return np.zeros_like(n), np.ones(n.shape, bool)
    ok = (boundary >= window) & (boundary < n)
    return np.where(ok, boundary, window), ok


def evaluate(model: Transformer, batches: Sequence[EvalBatch], boundaries: Sequence[int | None],
             settings_: Sequence[Setting], *, cut: int | None = None) -> list[dict]:
    """One result row per (setting, boundary): token means of the gap between (a) and each setting's path.

    ``boundaries``: absolute hit positions, ``None`` = cold prefill; a boundary outside ``[window, N)`` skips
    that conversation. Settings without ``replay`` are evaluated once, cold.
    """
    cfg = model.cfg
    cut = default_ced_cut(cfg) if cut is None else cut
    check_ced_cut(cfg, cut)
    w = cfg.attention.window_size
    exact_model = with_quant(model, CacheQuant(False, False, False))
    sums: dict[tuple[str, str], dict] = {}
    for batch in batches:
        a = exact_logits(exact_model, batch)
        for st in settings_:
            quant = CacheQuant(*(q in st.on for q in QUANT))
            variant = with_quant(model, quant)
            for boundary in boundaries if "replay" in st.on else [None]:
                hit, ok = _hits(batch, boundary, w)
                if st.engine:
                    b = engine_logits(variant, batch, np.where(hit > 0, hit, w), cut)
                else:
                    b = sim_logits(variant, batch, hit, cut if "ced" in st.on else None)
                m = gap_metrics(a, b, batch, response_mask(batch) & ok[:, None])
                key = (st.name, "cold" if boundary is None else str(boundary))
                acc = sums.setdefault(key, dict.fromkeys(m, 0.0))
                for k, v in m.items():
                    acc[k] = max(acc[k], v) if k == "dnll_max" else acc[k] + v
    return [_finish(name, boundary, s) for (name, boundary), s in sums.items()]


def _finish(name: str, boundary: str, s: dict) -> dict:
    n = max(s["tokens"], 1)
    return {"setting": name, "boundary": boundary, "tokens": int(s["tokens"]), "nll_exact": s["nll_exact"] / n,
            "nll_served": s["nll_served"] / n, "dnll": (s["nll_served"] - s["nll_exact"]) / n,
            "dnll_max": s["dnll_max"], "agree": s["agree"] / n, "kl": s["kl"] / n}


def format_table(rows: Sequence[dict]) -> str:
    head = f"{'setting':12s} {'boundary':>8s} {'tokens':>7s} {'NLL exact':>10s} {'ΔNLL':>10s} {'max|ΔNLL|':>10s} " \
           f"{'agree':>7s} {'KL(a‖b)':>10s}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['setting']:12s} {r['boundary']:>8s} {r['tokens']:7d} {r['nll_exact']:10.4f} "
                     f"{r['dnll']:+10.5f} {r['dnll_max']:10.5f} {100 * r['agree']:6.2f}% {r['kl']:10.3e}")
    return "\n".join(lines)


def write_jsonl(rows: Sequence[dict], path, **extra) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(extra | r) + "\n")


# ----------------------------------------------------------------------------------------------------
# held-out conversations of a run


def load_batches(pairs: Sequence[tuple[str, str]], cfg, tokenizer_path, hasher, sft, batch_size: int,
                 max_len: int) -> list[EvalBatch]:
    """Conversations under the chat template (:mod:`.sft`), cut to ``max_len`` tokens, in batches of one
    padded shape; prompts no longer than the window are skipped (no hit can land in them)."""
    from tokenizers import Tokenizer

    from dsv41_jax.posttrain.sft import encode_pair

    tok = Tokenizer.from_file(str(tokenizer_path))
    w = cfg.attention.window_size
    convs = [encode_pair(tok, cfg, sft, p, r) for p, r in pairs]
    convs = [(ids[:max_len], n) for ids, n in convs if w < n < min(len(ids), max_len)]
    if not convs:
        raise ValueError(f"no conversation has a prompt longer than the window ({w}) and a response within "
                         f"{max_len} tokens")
    length = -(-max(len(ids) for ids, _ in convs) // 8) * 8 + 8
    batches = []
    for lo in range(0, len(convs), batch_size):
        part = convs[lo: lo + batch_size]
        part += [(part[0][0][: part[0][1]], part[0][1])] * (batch_size - len(part))  # padding rows: no response
        tokens = np.full((batch_size, length), cfg.pad_token_id, np.int32)
        for i, (ids, _) in enumerate(part):
            tokens[i, : len(ids)] = ids
        rows = None
        if hasher is not None:
            rows = np.zeros((batch_size, length, len(cfg.engram.layer_ids), cfg.engram.n_columns), np.int32)
            for i, (ids, _) in enumerate(part):
                rows[i, : len(ids)] = hasher.row_ids(np.asarray(ids, np.int64)[None])[0][0]
        batches.append(EvalBatch(tokens, rows, np.asarray([n for _, n in part], np.int32),
                                 np.asarray([len(ids) for ids, _ in part], np.int32)))
    return batches


def _load(run, ckpt, hf_dir, mesh: str | None, log):
    """(model with the served cache formats, hasher, tokenizer.json, SFT settings, where from, mesh): a run's
    latest step with its own chat settings, or a converted / release checkpoint with the default ones."""
    from pathlib import Path

    from dsv41_jax.engine.mesh import load_for_serving, serving_mesh
    from dsv41_jax.posttrain.config import SFTConfig
    from dsv41_jax.posttrain.recipe import load_run_model, run_model_config, saved_run_config

    if run is None:
        loaded, on = load_for_serving(mesh, ckpt=ckpt, hf_dir=hf_dir, dtype="float32", param_dtype="float32",
                                      log=log)
        source = {"ckpt": str(ckpt)} if ckpt is not None else {"hf_dir": str(hf_dir)}
        return with_quant(loaded.model, CacheQuant()), loaded.hasher, loaded.tokenizer, SFTConfig(), source, on
    saved, step = saved_run_config(run)
    sft_dict = (saved.get("posttrain") or {}).get("sft") or {}
    sft = SFTConfig(**{k: v for k, v in sft_dict.items() if k != "paths"})
    on = serving_mesh(mesh, run_model_config(run, saved))
    model, hasher = load_run_model(run, dtype="float32", cache_quant=CacheQuant(), mesh=on)
    return model, hasher, Path(run) / "tokenizer.json", sft, {"run": str(run), "step": step}, on


def eval_run(data: Sequence[str], boundaries: Sequence[int | None], *, run=None, ckpt=None, hf_dir=None,
             mesh: str | None = None, ablations: bool = False, batch_size: int = 8, max_len: int = 256,
             max_pairs: int = 256, cut: int | None = None, out=None, log=print) -> list[dict]:
    """``dsv41 eval-served``: the gap table of a run's latest checkpoint (or of a converted / release checkpoint)
    on held-out prompt/response jsonl; ``mesh`` (``--mesh``): on that many devices."""
    from dsv41_jax.posttrain.sft import read_pairs

    model, hasher, tokenizer, sft, source, on = _load(run, ckpt, hf_dir, mesh, log)
    model = on_mesh(model, on)
    pairs = read_pairs(tuple(data), sft.prompt_key, sft.response_key, max_pairs)
    batches = load_batches(pairs, model.cfg, tokenizer, hasher if model.cfg.engram.layer_ids else None, sft,
                           batch_size, max_len)
    mesh_note = f" on mesh {dict(on.shape)}" if on is not None else ""
    title = " step ".join(str(v) for v in source.values())
    log(f"{title}: {sum(int((b.length > b.prompt_len).sum()) for b in batches)} conversations{mesh_note}")
    rows = evaluate(model, batches, boundaries, settings(ablations), cut=cut)
    log(format_table(rows))
    if out:
        write_jsonl(rows, out, **source)
    return rows
