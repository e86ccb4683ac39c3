"""DSpark drafter training (spec model §8.5): a frozen target run, many anchors per sequence, CE + TV + confidence.

``dsv41 train --config configs/dspark_tiny.yaml``: a run config whose ``dspark_train`` section names the target
(a ``dsv41 train`` run, its latest step). The target, and with it the shared embedding and LM head, is frozen:
its teacher-forced forward gives the DSpark features (``main_hidden``) and the target's next-token
distributions; only the drafter (stages, Markov head, confidence head) trains, with the V4.1 optimizer groups.

Anchors. Per sequence ``anchors`` positions ``p`` are drawn where the anchor token ``x_{p+1}`` and the block's
labels ``x_{p+2} .. x_{p+K+1}`` lie in ``p``'s document. Each anchor is one draft block exactly as at inference
(spec §8.3, the convention of our engine): ``[x_{p+1}, noise …]`` at positions ``p+1 … p+K``, seeing the keys of
the target positions ``p−W+1 … p`` (its own document's) and its own block only. The blocks are separate rows
of the drafter's batch, which is the block-diagonal mask. [OPEN] choice: NeMo places the anchor at ``anchor+1``
and lets the block see the anchor's own features; we keep §8.3's (the drafter is then trained on exactly what
the engine shows it). The Markov bias of slot ``i`` uses the ground-truth token before it (teacher forcing).

Loss per slot ``i`` (weights ``w_i ∝ position_decay^i``, summing to 1): ``ce · CE(q_i, x) + tv · TV(p_i, q_i)
+ conf · BCE(σ(conf_i), 1 − TV(p_i, q_i))``, the confidence target without gradient (``1 − TV`` is the
acceptance probability of rejection sampling). λ's and the decay are [OPEN] in the sources; ours are in the
config. Sequences come from the target's corpus (teacher forcing on data, not target-generated text).

Post-training changes the target under its drafter: ``target`` may be a post-training run (``dsv41 train`` of a
``posttrain`` config) and ``init_from`` the drafter trained for its source, which this run then fine-tunes
against the new target, the backbone still frozen.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.config import ConfigError
from dsv41_jax.model.dspark import DSpark
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.optim import OptimConfig, optimizer


@dataclasses.dataclass(frozen=True)
class DSparkTrainConfig:
    target: str  # a `dsv41 train` run directory: the frozen target (its latest step)
    out: str  # the drafter's directory: drafter.npz (mtp.* arrays), metrics.jsonl, eval.json
    # a drafter.npz to start from instead of random weights: the drafter of the target before its post-training,
    # kept in step with the post-trained target (whose weights, as always here, get no gradient)
    init_from: str = ""
    steps: int = 300
    lr: float = 1.0e-3
    lr_floor: float = 1.0e-4
    warmup_steps: int = 20
    batch_size: int = 8
    seq_len: int = 128
    anchors: int = 16  # anchor positions per sequence
    ce_weight: float = 1.0
    tv_weight: float = 1.0
    conf_weight: float = 0.5
    position_decay: float = 0.8  # slot i weighs position_decay^i (normalised)
    seed: int = 0
    log_every: int = 10
    # mean accepted length on held-out documents: speculative greedy decoding in the engine
    eval_documents: int = 8  # documents after the target's training corpus
    eval_prompt_tokens: int = 64
    eval_new_tokens: int = 48
    eval_drafts: int = 0  # drafts per step (0: the block size)


class LossSettings(Protocol):
    """What :func:`dspark_loss` reads of a config (:class:`DSparkTrainConfig`, or post-training's
    ``posttrain.drafter`` section)."""

    anchors: int
    ce_weight: float
    tv_weight: float
    conf_weight: float
    position_decay: float


def is_dspark_config(path: str | Path) -> bool:
    """Whether a run config trains a DSpark drafter (a top-level ``dspark_train`` section)."""
    from dsv41_jax.config.loaders import read_yaml

    data = read_yaml(path)
    return isinstance(data, dict) and "dspark_train" in data


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> DSparkTrainConfig:
    """The ``dspark_train`` section of a YAML run config, with dotted ``dspark_train.key=value`` overrides."""
    from dsv41_jax.config.loaders import read_yaml

    data = read_yaml(path, "dspark_train")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: dspark_train must be a mapping of keys")
    data = dict(data)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("dspark_train."):
            raise ConfigError(f"{path}: override {item!r}: expected dspark_train.KEY=VALUE")
        data[key.removeprefix("dspark_train.")] = value
    fields = {f.name: f for f in dataclasses.fields(DSparkTrainConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{path}: unknown dspark_train keys {unknown}; known: {sorted(fields)}")
    missing = sorted(n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in data)
    if missing:
        raise ConfigError(f"{path}: dspark_train needs {missing}")
    typed = {}
    for name, value in data.items():
        kind = type(fields[name].default) if fields[name].default is not dataclasses.MISSING else str
        try:
            typed[name] = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: dspark_train.{name} = {value!r} is not a {kind.__name__}") from None
    cfg = DSparkTrainConfig(**typed)
    for name in ("steps", "batch_size", "seq_len", "anchors", "log_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{path}: dspark_train.{name} must be ≥ 1, got {getattr(cfg, name)}")
    if not 0 <= cfg.warmup_steps < cfg.steps:
        raise ConfigError(f"{path}: dspark_train.warmup_steps ({cfg.warmup_steps}) must be below steps ({cfg.steps})")
    if not 0 < cfg.position_decay <= 1:
        raise ConfigError(f"{path}: dspark_train.position_decay must be in (0, 1], got {cfg.position_decay}")
    return cfg


def pick_anchors(key: jax.Array, segment_ids: jax.Array, n: int, block: int) -> tuple[jax.Array, jax.Array]:
    """``(p [B, n], valid [B, n])``: anchor positions whose anchor token and ``block`` labels stay in the document
    of ``p``, drawn uniformly without replacement (fewer valid positions than ``n``: the rest are invalid)."""
    b, s = segment_ids.shape
    seg = jnp.pad(segment_ids, ((0, 0), (0, block + 1)))
    ok = (segment_ids > 0) & jnp.all(jnp.stack([seg[:, j: j + s] == segment_ids for j in range(1, block + 2)]), 0)
    scores = jnp.where(ok, jax.random.uniform(key, (b, s)), -1.0)
    top, p = jax.lax.top_k(scores, n)
    return p.astype(jnp.int32), top >= 0


def anchored_drafts(drafter: DSpark, target: Transformer, batch: dict, main_hidden: jax.Array, p: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The draft block of every anchor ``p`` [B, A] (one row of the drafter's batch each, the block-diagonal
    mask): ``(logits [B·A, K, V], confidence [B·A, K], block tokens [B, A, K+1])``, the block tokens being the
    anchor token and the K labels, the Markov bias of each slot from the true token before it."""
    mc = drafter.cfg
    k, w = mc.dspark.block_size, mc.attention.window_size
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    b, a = p.shape
    rows = jnp.arange(b)[:, None]
    main_x = drafter.main_x(main_hidden)
    before = p[..., None] - w + 1 + jnp.arange(w)  # the target positions each block sees: [B, A, W]
    at = jnp.maximum(before, 0)
    seen = (before >= 0) & (seg[rows[..., None], at] == seg[rows, p][..., None])  # its own document's
    keys_before = tuple(stage.attn.window_kv(main_x, pos)[rows[..., None], at].reshape(b * a, w, -1)
                        for stage in drafter.mtp)
    pos_before = jnp.where(seen, pos[rows[..., None], at], -1).reshape(b * a, w)
    block_tokens = tokens[rows[..., None], jnp.minimum(p[..., None] + 1 + jnp.arange(k + 1), tokens.shape[1] - 1)]
    start = pos[rows, jnp.minimum(p + 1, tokens.shape[1] - 1)].reshape(-1)
    h, base = drafter.block(target, block_tokens[..., 0].reshape(-1), start, keys_before, pos_before)
    logits, conf = drafter.heads(base, h, block_tokens[..., :k].reshape(-1, k))
    return logits, conf, block_tokens


def dspark_loss(drafter: DSpark, target: Transformer, batch: dict, target_logits: jax.Array,
                main_hidden: jax.Array, key: jax.Array, cfg: LossSettings) -> tuple[jax.Array, dict]:
    """The anchored training loss of one batch (``tokens``, ``segment_ids``, ``positions`` [B, S]) given the
    frozen target's logits [B, S, V] and features [B, S, F]; returns ``(loss, metrics)``."""
    k = drafter.cfg.dspark.block_size
    p, valid = pick_anchors(key, batch["segment_ids"], cfg.anchors, k)  # [B, A]
    logits, conf, block_tokens = anchored_drafts(drafter, target, batch, main_hidden, p)
    rows = jnp.arange(p.shape[0])[:, None, None]
    labels = block_tokens[..., 1:].reshape(-1, k)
    log_q = jax.nn.log_softmax(logits, -1)
    ce = -jnp.take_along_axis(log_q, labels[..., None], -1)[..., 0]
    v = target_logits.shape[-1]
    p_target = jax.nn.softmax(target_logits[rows, p[..., None] + 1 + jnp.arange(k)].reshape(-1, k, v), -1)
    tv = 0.5 * jnp.abs(p_target - jnp.exp(log_q)).sum(-1)
    accept = jax.lax.stop_gradient(1.0 - tv)
    bce = jax.nn.softplus(conf) - accept * conf  # BCE(σ(conf), 1 − TV) from the logit
    weights = cfg.position_decay ** jnp.arange(k, dtype=jnp.float32)
    weights = weights / weights.sum()
    slot = valid.reshape(-1, 1).astype(jnp.float32)
    mask = slot * weights
    n = jnp.maximum(valid.sum(), 1)
    loss = ((cfg.ce_weight * ce + cfg.tv_weight * tv + cfg.conf_weight * bce) * mask).sum() / n
    greedy = jnp.argmax(logits, -1) == jnp.argmax(p_target, -1)
    metrics = {"loss": loss, "ce": (ce * mask).sum() / n, "tv": (tv * mask).sum() / n, "bce": (bce * mask).sum() / n,
               "accept_slot0": (accept[:, 0] * slot[:, 0]).sum() / n,
               "greedy_match_slot0": (greedy[:, 0] * slot[:, 0]).sum() / n, "anchors": valid.sum()}
    return loss, metrics


def drafter_update(drafter: DSpark, target_graph, tx: optax.GradientTransformation, cfg: LossSettings):
    """The pure step ``(params, opt_state, target_state, batch, key) -> (params, opt_state, metrics)``.

    ``target_state``: the target's states as a tuple (``nnx.merge(target_graph, *target_state)``), an input so
    that post-training hands in its current weights; they are frozen (only the drafter's ``params`` are
    differentiated, the target's logits and features are constants). A non-finite loss or gradient leaves
    the drafter and its optimizer as they were (metric ``skipped`` 1.0)."""
    dgraph, _, drest = nnx.split(drafter, nnx.Param, ...)

    def step(params, opt_state, target_state, batch, key):
        t = nnx.merge(target_graph, *target_state)
        logits, aux = t(batch["tokens"], batch.get("engram_rows"), segment_ids=batch["segment_ids"],
                        positions=batch["positions"], return_aux=True)
        logits, main_hidden = jax.lax.stop_gradient((logits, aux.main_hidden))  # the target is frozen

        def loss_fn(params):
            return dspark_loss(nnx.merge(dgraph, params, drest), t, batch, logits, main_hidden, key, cfg)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, new_opt = tx.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
        new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), (optax.apply_updates(params, updates), new_opt),
                           (params, opt_state))
        return *new, metrics | {"skipped": 1.0 - ok.astype(jnp.float32)}

    return step


def make_step(drafter: DSpark, target: Transformer, tx: optax.GradientTransformation, cfg: DSparkTrainConfig):
    """The jitted training step ``(params, opt_state, batch, key) -> (params, opt_state, metrics)`` against the
    frozen ``target``."""
    tgraph, tstate = nnx.split(target)
    update = jax.jit(drafter_update(drafter, tgraph, tx, cfg))
    return lambda params, opt_state, batch, key: update(params, opt_state, (tstate,), batch, key)


def train_dspark(config: str | Path, overrides: list[str] | tuple[str, ...] = (), *,
                 log: Callable[[str], None] = print) -> dict:
    """``dsv41 train`` of a ``dspark_train`` config: train, save ``<out>/drafter.npz``, then measure the mean
    accepted length on held-out documents (``<out>/eval.json``). Returns the evaluation."""
    from dsv41_jax.data.corpus import open_documents
    from dsv41_jax.data.pipeline import packed_dataset
    from dsv41_jax.posttrain.recipe import load_run_model, saved_run_config

    cfg = load_config(config, overrides)
    saved, step = saved_run_config(cfg.target)
    target, hasher = load_run_model(cfg.target, dtype="float32")
    mc = target.cfg
    if mc.dspark.n_layers < 1:
        raise ConfigError(f"{config}: the target's model has no DSpark stages (model.dspark.n_layers = 0)")
    log(f"target {cfg.target} step {step} (frozen); drafter: {mc.dspark.n_layers} stages, block "
        f"{mc.dspark.block_size}, features of layers {mc.dspark.target_layer_ids}")
    drafter = load_drafter_npz(cfg.init_from, mc) if cfg.init_from else DSpark(mc, rngs=nnx.Rngs(cfg.seed))
    if cfg.init_from:
        log(f"drafter from {cfg.init_from}")
    _, params, _ = nnx.split(drafter, nnx.Param, ...)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.lr_floor)
    ocfg = OptimConfig(warmup_steps=cfg.warmup_steps, constant_until=cfg.warmup_steps, decay_until=cfg.steps,
                       total_steps=cfg.steps)  # the schedule itself is `schedule`
    tx = optimizer(mc, ocfg, lr=schedule)
    opt_state = tx.init(params)
    step_fn = make_step(drafter, target, tx, cfg)
    d = saved["data"]
    cap = d["max_documents"]  # the pre-training run's documents (null: all), then the held-out ones
    docs = open_documents(d["source"], tuple(d.get("paths") or ()), None if cap is None else cap + cfg.eval_documents)
    n_train = len(docs) - cfg.eval_documents if cap is None else min(cap, len(docs) - cfg.eval_documents)
    train_docs, held_out = [docs[i] for i in range(n_train)], [docs[i] for i in range(n_train, len(docs))]
    tok_path = Path(cfg.target) / "tokenizer.json"
    data = iter(packed_dataset(train_docs, tok_path, mc, hasher.token_map, seq_len=cfg.seq_len,
                               batch_size=cfg.batch_size, seed=cfg.seed, read_threads=0))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    key = jax.random.key(cfg.seed)
    tick = time.perf_counter()
    with open(out / "metrics.jsonl", "w") as metrics_file:
        for i in range(1, cfg.steps + 1):
            batch = {k: jnp.asarray(v) for k, v in next(data).items()}
            params, opt_state, metrics = step_fn(params, opt_state, batch, jax.random.fold_in(key, i))
            if i % cfg.log_every == 0 or i == cfg.steps:
                m = {k: float(v) for k, v in jax.device_get(metrics).items()} | {
                    "step": i, "step_s": (time.perf_counter() - tick) / cfg.log_every}
                tick = time.perf_counter()
                metrics_file.write(json.dumps(m) + "\n")
                metrics_file.flush()
                log(f"step {i:5d}  loss {m['loss']:.4f}  ce {m['ce']:.3f}  tv {m['tv']:.3f}  bce {m['bce']:.3f}  "
                    f"slot-0 acceptance {m['accept_slot0']:.3f}  greedy match {m['greedy_match_slot0']:.3f}")
    nnx.update(drafter, params)
    save_drafter(drafter, out / "drafter.npz")
    result = evaluate(target, hasher, drafter, held_out, tok_path, cfg)
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    log(f"held-out ({result['documents']} documents, {result['drafts_per_step']} drafts per step): mean accepted "
        f"length {result['mean_accepted_length']:.3f} tokens per step, {result['accepted']}/{result['drafted']} "
        f"drafts accepted; speculative output equals plain greedy: {result['equals_plain']}")
    return result


def save_drafter(drafter: DSpark, path: Path) -> None:
    from dsv41_jax.checkpoint.tree import flat_variables

    np.savez(path, **{name: np.asarray(v[...]) for name, v in flat_variables(drafter).items()})


def load_drafter_npz(path: str | Path, cfg: C.ModelConfig) -> DSpark:
    """A drafter saved by :func:`train_dspark` (``drafter.npz``), for the backbone config ``cfg``; ``path`` may be
    a URI (read through ``etils.epath``)."""
    from etils import epath

    from dsv41_jax.checkpoint.tree import assign

    drafter = DSpark(cfg, rngs=nnx.Rngs(0))
    with epath.Path(path).open("rb") as f, np.load(f) as arrays:
        assign(drafter, dict(arrays), ignore_prefixes=())
    return drafter


def evaluate(target: Transformer, hasher, drafter: DSpark, documents: list[str], tok_path: Path,
             cfg: DSparkTrainConfig) -> dict:
    """Speculative greedy decoding from each held-out document's first ``eval_prompt_tokens`` tokens: the mean
    accepted length (tokens emitted per verify step) and whether the output is plain greedy decoding's."""
    from tokenizers import Tokenizer

    from dsv41_jax.engine.sampling import Generator, SamplingConfig
    from dsv41_jax.engram_device import device_engram

    mc = target.cfg
    tok = Tokenizer.from_file(str(tok_path))
    prompts = [[mc.bos_token_id, *tok.encode(text, add_special_tokens=False).ids][: cfg.eval_prompt_tokens]
               for text in documents]
    prompts = [p for p in prompts if len(p) == cfg.eval_prompt_tokens]
    if not prompts:
        raise ConfigError(f"no held-out document has {cfg.eval_prompt_tokens} tokens to prompt with")
    k = cfg.eval_drafts or mc.dspark.block_size
    length = cfg.eval_prompt_tokens + cfg.eval_new_tokens
    max_seq_len = -(-length // 2) * 2
    sampling = SamplingConfig(temperature=0, max_new_tokens=cfg.eval_new_tokens, stop_tokens=(), block=8,
                              prefill_chunk=cfg.eval_prompt_tokens, speculative=k)
    gen = Generator(target, device_engram(hasher), len(prompts), max_seq_len + 2, sampling, drafter=drafter)
    spec = gen.generate(prompts)
    stats = {name: int(v.sum()) for name, v in gen.stats.items()}
    plain = gen.generate(prompts, speculative=False)
    return {"documents": len(prompts), "drafts_per_step": k, **stats,
            "mean_accepted_length": (stats["accepted"] + stats["steps"]) / max(stats["steps"], 1),
            "equals_plain": spec == plain}
