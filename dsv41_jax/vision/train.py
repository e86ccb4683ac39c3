"""Image–text training (spec model §7.4 stage 3): the objective, the optimizer groups of the tower, the run.

The step is the one of pre-training (:func:`dsv41_jax.train.step.make_step`) with :func:`vision_objective`:
next-token cross-entropy on the caption tokens of packed image–text rows (a target inside an image span is
not a token to predict), the sequence balance loss, and the aux-loss-free rule moving ``bias`` by the text
tokens' loads and ``bias_vl`` by the image tokens' (spec model §5.3).

Optimizer (stage 3): the backbone's groups as in pre-training; the aligner's matrices by Muon and its biases,
the span delimiters and ``vision.norm`` by AdamW, all at ``vision.lr_mult`` × the schedule; the rest of the
ViT frozen (zero updates) unless ``vision.freeze_encoder`` is false, when it trains like the aligner.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.optim import OptimConfig, balance_loss
from dsv41_jax.optim import labels as L
from dsv41_jax.optim.optimizer import adamw, group_transforms, muon
from dsv41_jax.optim.schedule import lr_schedule
from dsv41_jax.train.step import (
    LossAux,
    Objective,
    Term,
    TrainState,
    batch_sharding,
    count,
    make_step,
    split_model,
    state_shardings,
    targets_and_mask,
    token_nll,
)
from dsv41_jax.vision.config import VisionTrainConfig
from dsv41_jax.vision.data import EncodePair, packed_pairs
from dsv41_jax.vision.model import VisionLanguageModel
from dsv41_jax.vision.synthetic import ATTRIBUTES, example

VISION_MUON, VISION_ADAMW, VISION_NO_DECAY, VISION_FROZEN = "vision_muon", "vision_adamw", "vision_no_decay", \
    "vision_frozen"
_TOWER = re.compile(r"^(?:vision\.|aligner\.|image_(?:start|end|newline)$)")


def vision_label(name: str, freeze_encoder: bool) -> str:
    """The group of a tower parameter (``vision.*``, ``aligner.*``, ``image_*``)."""
    if name == "vision.norm.weight":
        return VISION_ADAMW  # stage 3 trains the encoder's final norm
    if name.startswith("vision.") and freeze_encoder:
        return VISION_FROZEN
    if name.endswith(".weight") and not re.search(r"norm\d?\.weight$", name):
        return VISION_MUON  # linear matrices (the patch embedding is linear "for Muon compatibility", §7.4)
    return VISION_ADAMW if name.endswith(".weight") else VISION_NO_DECAY  # norms; biases and delimiters


def vision_optimizer(model_cfg: ModelConfig, ocfg: OptimConfig, vcfg: VisionTrainConfig
                     ) -> optax.GradientTransformation:
    """The pre-training optimizer over the backbone plus the stage-3 groups over the tower."""
    base = lr_schedule(ocfg)
    lr = lambda step: vcfg.lr_mult * base(step)
    transforms = group_transforms(model_cfg, ocfg) | {
        VISION_MUON: muon(ocfg, 1, lr), VISION_ADAMW: adamw(ocfg, ocfg.weight_decay, lr),
        VISION_NO_DECAY: adamw(ocfg, 0.0, lr), VISION_FROZEN: optax.set_to_zero()}

    def label(name: str) -> str:
        return vision_label(name, vcfg.freeze_encoder) if _TOWER.search(name) else L.label_of(name)

    return optax.partition(transforms, lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: label(L.path_name(path)), params))


def abstract_vision_model(cfg: ModelConfig) -> VisionLanguageModel:
    """:class:`VisionLanguageModel` with abstract leaves (shapes and shardings, no memory)."""
    return nnx.eval_shape(lambda: VisionLanguageModel(cfg, rngs=nnx.Rngs(0)))


def caption_mask(tokens, token_types, segment_ids):
    """(targets, mask): next tokens, counted where the next position is text of the same example."""
    targets, mask = targets_and_mask(tokens, segment_ids)
    next_text = jnp.concatenate([token_types[:, 1:] < 0, jnp.zeros_like(token_types[:, :1], bool)], axis=1)
    return targets, mask & next_text


def image_text_logits(model: VisionLanguageModel, mb: dict, remat: str = "none"):
    """``(logits, aux)`` of the forward over a packed image–text micro-batch."""
    embeds = model.image_embeds(mb["patches"], mb["token_types"], mb["image_slot"])
    return model(mb["tokens"], mb.get("engram_rows"), mb["token_types"] >= 0, image_embeds=embeds,
                 segment_ids=mb["segment_ids"], positions=mb["positions"], return_aux="routing", remat=remat)


def vision_objective(ocfg: OptimConfig, remat: str = "none") -> Objective:
    def counts(batch):
        return {"tokens": count(jax.vmap(caption_mask)(batch["tokens"], batch["token_types"],
                                                       batch["segment_ids"])[1])}

    def loss(model, mb, key):
        logits, aux = image_text_logits(model, mb, remat)
        targets, mask = caption_mask(mb["tokens"], mb["token_types"], mb["segment_ids"])
        real = mb["segment_ids"] > 0
        sums = {"ce": jnp.sum(token_nll(logits, targets) * mask), "balance": balance_loss(aux.routing,
                                                                                          ocfg.seq_balance_alpha, real)}
        image = real & (mb["token_types"] >= 0)
        n = len(aux.routing)
        return LossAux(sums, tuple(r.experts for r in aux.routing), (real,) * n, (image,) * n)

    return Objective({"ce": Term(1.0, "tokens"), "balance": Term(1.0, "micro_batches")}, counts, loss)


def setup_vision(cfg, model_cfg: ModelConfig, mesh, tok_path: Path, token_map: np.ndarray, log=print):
    """``(state, jitted step, dataset, data, evaluate)`` of an image–text run (the loop restores a checkpoint
    of the run over this fresh state when there is one)."""
    from dsv41_jax.data.pipeline import DataState

    vcfg, d = cfg.vision, cfg.data
    tx = vision_optimizer(model_cfg, cfg.optim, vcfg)
    model = VisionLanguageModel(model_cfg, rngs=nnx.Rngs(cfg.seed))
    shardings, (graphdef, rest) = state_shardings(model, tx, mesh)
    _, params, biases, _ = split_model(model)
    state = jax.device_put(TrainState(jnp.zeros((), jnp.int32), params, biases, tx.init(params)), shardings)
    step = make_step(graphdef, rest, cfg.optim, tx, vision_objective(cfg.optim, cfg.remat), mesh=mesh, seed=cfg.seed)
    step = jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)), out_shardings=(shardings, None),
                   donate_argnums=0)
    ds = packed_pairs(vcfg, model_cfg, tok_path, token_map, seq_len=d.seq_len, batch_size=d.batch_size,
                      seed=cfg.seed, process_index=jax.process_index(), process_count=jax.process_count())
    log(f"image–text data: {vcfg.source}, images {vcfg.image_size}² ({ds.image_rows} aligner rows, up to "
        f"{ds.max_images} per row); encoder {'frozen but vision.norm' if vcfg.freeze_encoder else 'trained'}, "
        f"vision lr × {vcfg.lr_mult}")
    encode = EncodePair(tok_path, model_cfg, token_map, vcfg.image_size)
    evaluate = lambda st: caption_accuracy(graphdef, rest, st, encode, d.seq_len, vcfg.eval_examples,
                                           seed=cfg.seed + 1, image_size=vcfg.image_size)
    return state, step, ds, DataState(ds), evaluate


def caption_accuracy(graphdef, rest, state: TrainState, encode: EncodePair, seq_len: int, n: int, *, seed: int,
                     image_size: int, batch: int = 16) -> dict[str, float]:
    """Per attribute (colour, shape, place, the written word) of held-out synthetic pairs: the fraction whose
    word the model predicts exactly (every token argmax-correct, the caption teacher-forced up to it). Chance is
    1/4 each."""
    from dsv41_jax.vision.data import _pack_row, _stack

    forward = jax.jit(lambda st, mb: image_text_logits(nnx.merge(graphdef, st.params, st.biases, rest), mb)[0])
    hits = {a: 0 for a in ATTRIBUTES}
    tok = encode.tok
    for lo in range(0, n, batch):
        exs = [example(i, seed, image_size) for i in range(lo, min(lo + batch, n))]
        rows = [_pack_row([encode((e.rgb, e.caption))], seq_len, 1, encode.plan.n_llm_h * encode.plan.n_llm_w)
                for e in exs]
        mb = {k: jnp.asarray(v) for k, v in _stack(rows).items()}
        pred = np.asarray(forward(state, mb).argmax(-1))
        for r, e in enumerate(exs):
            start = 1 + len(encode.types)  # first caption position
            for a, word in e.attributes.items():
                at, ids = _word_span(tok, e.caption, word)
                hits[a] += bool(np.all(pred[r, start + at - 1: start + at - 1 + len(ids)] ==
                                       rows[r]["tokens"][start + at: start + at + len(ids)]))
    return {f"caption_{a}_accuracy": h / n for a, h in hits.items()}


def _word_span(tok, caption: str, word: str) -> tuple[int, list[int]]:
    """(index of the word's first token in the caption's tokens, its tokens), counting the space before it: a
    byte-level tokenizer may spell that space alone (``Ġ``, ``K``, ``E``, ``Y``), and a bare space must not
    give the word away to teacher forcing."""
    enc = tok.encode(caption, add_special_tokens=False)
    space = caption.index(f" {word}")
    idx = [i for i, (s, e) in enumerate(enc.offsets) if e > space and s < space + 1 + len(word)]
    return idx[0], [enc.ids[i] for i in idx]

