"""Image–text training pieces: sources, packing that keeps spans whole, the caption targets, the stage-3
optimizer groups and the bias_vl rule. The run itself (configs/vision_tiny.yaml, minutes on a CPU) is not
part of this suite: its compiled step alone costs more than the suite's budget for vision."""

from __future__ import annotations

import io
import json
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import config as C
from dsv41_jax.engram_hash import build_token_map
from dsv41_jax.optim import OptimConfig
from dsv41_jax.optim.labels import path_name
from dsv41_jax.testing import GOLDEN
from dsv41_jax.train.config import load
from dsv41_jax.train.step import bias_update, split_model
from dsv41_jax.vision.config import VisionTrainConfig
from dsv41_jax.vision.data import FolderSource, TarSource, packed_pairs
from dsv41_jax.vision.model import VisionLanguageModel
from dsv41_jax.vision.spans import IMAGE, IMAGE_END, IMAGE_START
from dsv41_jax.vision.synthetic import ATTRIBUTES, COLOURS, OPPOSITE, example, word_ink
from dsv41_jax.vision.train import VISION_FROZEN, _word_span, caption_mask, vision_label, vision_optimizer

PIL = pytest.importorskip("PIL.Image")
TOKENIZER = GOLDEN / "tiny_hf" / "tokenizer.json"
S = 112  # room for two examples of 43-51 tokens (the golden tokenizer spells captions nearly letter by letter)
SPAN = 8  # an 84² image: 6×6 patches, a 2×2 aligner grid, 2·(2+1) + 2 positions


@pytest.fixture(scope="module")
def packed():
    cfg = C.tiny()
    vcfg = VisionTrainConfig(image_size=84, synthetic_examples=1000)
    return cfg, packed_pairs(vcfg, cfg, TOKENIZER, build_token_map(TOKENIZER), seq_len=S, batch_size=3, seed=0)


def test_packing_keeps_spans_and_captions_whole(packed):
    cfg, ds = packed
    batch = next(ds)
    assert batch["patches"].shape[:3] == (3, ds.max_images, 36) and ds.image_rows == 4
    for r in range(3):
        seg, types, tok = batch["segment_ids"][r], batch["token_types"][r], batch["tokens"][r]
        for j in range(1, seg.max() + 1):
            ex = np.flatnonzero(seg == j)  # one example: BOS, its whole span, its caption, EOS
            assert tok[ex[0]] == cfg.bos_token_id and tok[ex[-1]] == cfg.eos_token_id
            assert types[ex[1]] == IMAGE_START and types[ex[1] + SPAN - 1] == IMAGE_END
            slots = ex[types[ex] == IMAGE]
            np.testing.assert_array_equal(batch["image_slot"][r, slots], (j - 1) * 4 + np.arange(4))
            assert (tok[ex[1]: ex[1] + SPAN] == cfg.image_token_id).all()
            np.testing.assert_array_equal(batch["positions"][r, ex], np.arange(len(ex)))
        pad = np.flatnonzero(seg == 0)
        assert len(pad) == 0 or (pad == np.arange(pad[0], S)).all()  # padding only after the last example
    # resuming from the state gives the same next batch
    state = ds.get_state()
    want = next(ds)
    ds.set_state(state)
    got = next(ds)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_captions_are_the_only_targets(packed):
    _, ds = packed
    b = next(ds)
    targets, mask = caption_mask(jnp.asarray(b["tokens"]), jnp.asarray(b["token_types"]), jnp.asarray(b["segment_ids"]))
    mask = np.asarray(mask)
    nxt = np.roll(b["token_types"], -1, axis=1)
    assert not mask[nxt >= 0].any()  # never predict a span position
    ends = np.flatnonzero(b["token_types"][0] == IMAGE_END)
    assert mask[0, ends].all()  # the span's last position predicts the caption's first token


def _half(place: str, size: int) -> tuple[slice, slice]:
    h = size // 2
    return {"left": (slice(None), slice(0, h)), "right": (slice(None), slice(size - h, None)),
            "top": (slice(0, h), slice(None)), "bottom": (slice(size - h, None), slice(None))}[place]


def _best_word(gray: np.ndarray, size: int) -> str:
    """The word whose rendering correlates best (normalised, over every offset) with ``gray``."""
    def ncc(glyph):
        win = np.lib.stride_tricks.sliding_window_view(gray, glyph.shape)
        win = win - win.mean(axis=(-2, -1), keepdims=True)
        g = glyph - glyph.mean()
        return (np.einsum("ijhw,hw->ij", win, g) / (np.linalg.norm(win, axis=(-2, -1)) * np.linalg.norm(g))).max()
    return max(ATTRIBUTES["word"], key=lambda w: ncc(word_ink(w, size)))


@pytest.mark.parametrize("size", [84, 56])
def test_synthetic_pictures_show_what_the_caption_says(size):
    """The shape in its colour lies in the captioned half, the light letters in the other half spell the captioned
    word (of the four, the best match of their rendering), and each attribute value comes up about 1/4 of the time."""
    for i in range(12):
        e = example(i, 1, size)
        a, img = e.attributes, e.rgb.astype(np.float64)
        assert e.caption == f"a {a['colour']} {a['shape']} on the {a['place']} and the word {a['word']}"
        colour = np.asarray(COLOURS[a["colour"]], np.float64)
        shape = np.linalg.norm(img / np.linalg.norm(img, axis=-1, keepdims=True) - colour / np.linalg.norm(colour),
                               axis=-1) < 0.05
        ink = img.min(-1) > 200  # the letters; the grey background (110 ± 12) and the colours stay below
        assert shape.sum() > size * size / 20 and shape[_half(a["place"], size)].sum() == shape.sum()
        assert ink.sum() > size // 8 and ink[_half(OPPOSITE[a["place"]], size)].sum() == ink.sum()
        assert _best_word(img.mean(-1)[_half(OPPOSITE[a["place"]], size)], size) == a["word"], (i, a)
    seen = [example(i, 2, 28).attributes for i in range(400)]
    for name, values in ATTRIBUTES.items():
        counts = [sum(s[name] == v for s in seen) for v in values]
        assert min(counts) > 70 and max(counts) < 130, (name, counts)  # 100 each expected


def test_caption_accuracy_counts_each_word_from_the_space_before_it():
    """The evaluated tokens of an attribute word start at the space before it, even where the tokenizer spells
    that space alone (a bare space after teacher forcing would give the word away)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    for i in range(8):
        e = example(i)
        ids = tok.encode(e.caption, add_special_tokens=False).ids
        for word in e.attributes.values():
            at, span = _word_span(tok, e.caption, word)
            assert ids[at: at + len(span)] == span and tok.decode(span) == f" {word}", (e.caption, word)


def test_folder_and_webdataset_sources(tmp_path):
    exs = [example(i, 3, 56) for i in range(3)]
    lines = []
    tar_path = tmp_path / "shard-000.tar"
    with tarfile.open(tar_path, "w") as tar:
        for i, e in enumerate(exs):
            buf = io.BytesIO()
            PIL.fromarray(e.rgb).save(buf, format="PNG")
            (tmp_path / f"{i}.png").write_bytes(buf.getvalue())
            lines.append(json.dumps({"image": f"{i}.png", "caption": e.caption}))
            for name, data in ((f"k{i}.png", buf.getvalue()), (f"k{i}.txt", e.caption.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (tmp_path / "captions.jsonl").write_text("\n".join(lines))
    for source in (FolderSource((str(tmp_path),)), TarSource((str(tar_path),))):
        assert len(source) == 3
        for i, e in enumerate(exs):
            rgb, text = source[i]
            assert text == e.caption and np.array_equal(rgb, e.rgb)


def test_stage3_groups_freeze_the_encoder_but_its_final_norm():
    cfg = C.tiny().replace(dtype="float32")
    model = VisionLanguageModel(cfg, rngs=nnx.Rngs(0))
    _, params, _, _ = split_model(model)
    all_params = {path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    frozen = {n for n in all_params if vision_label(n, True) == VISION_FROZEN}
    assert frozen == {n for n in all_params if n.startswith("vision.") and n != "vision.norm.weight"}
    # one tower parameter of each kind (ViT matrix, bias, block norm, final norm, aligner matrix and bias, span
    # delimiter) and one backbone matrix, a flat tree named like the checkpoint, as the labels read it; the
    # frozen set is checked above over every parameter
    kinds = ("vision.blocks.0.attn.wqkv.weight", "vision.blocks.0.attn.wqkv.bias", "vision.blocks.0.norm1.weight",
             "vision.norm.weight", "aligner.w2.weight", "aligner.w2.bias", "image_start")
    sub = {n: all_params[n] for n in (*kinds, "layers.0.attn.wq_a.weight")}
    grads = jax.tree.map(jnp.ones_like, sub)
    ocfg = OptimConfig(lr=1e-2, warmup_steps=1)
    for freeze, trained in ((True, set(kinds) - frozen), (False, set(kinds))):
        tx = vision_optimizer(cfg, ocfg, VisionTrainConfig(freeze_encoder=freeze, lr_mult=0.5))
        updates, _ = tx.update(grads, tx.init(sub), sub)
        moved = {n for n, u in updates.items() if np.abs(np.asarray(u)).max() > 0}
        assert moved - {"layers.0.attn.wq_a.weight"} == trained, sorted(moved)
        assert "layers.0.attn.wq_a.weight" in moved  # the backbone trains at the schedule's rate


def test_bias_vl_moves_by_image_tokens_only():
    e = 4
    biases = {"layers": {0: {"ffn": {"gate": {"bias": jnp.zeros(e), "bias_vl": jnp.zeros(e)}}}}}
    experts = [jnp.array([[[0, 1], [0, 1], [2, 3]]])]  # three tokens; the last is an image token
    live = [jnp.array([[True, True, True]])]
    image = [jnp.array([[False, False, True]])]
    text_only = bias_update(biases, experts, live, 1.0)["layers"][0]["ffn"]["gate"]
    np.testing.assert_array_equal(text_only["bias_vl"], np.zeros(e))
    np.testing.assert_array_equal(text_only["bias"], [-1, -1, 1, 1])  # all three as text: loads [2, 2, 1, 1]
    both = bias_update(biases, experts, live, 1.0, image)["layers"][0]["ffn"]["gate"]
    np.testing.assert_array_equal(both["bias"], [-1, -1, 1, 1])  # loads [2, 2, 0, 0] of the text tokens
    np.testing.assert_array_equal(both["bias_vl"], [1, 1, -1, -1])  # loads [0, 0, 1, 1] of the image token


def test_vision_tiny_config_parses():
    cfg = load(GOLDEN.parents[2] / "configs" / "vision_tiny.yaml")
    assert cfg.vision.source == "synthetic" and cfg.vision.image_size % cfg.model.vision.patch_size == 0
