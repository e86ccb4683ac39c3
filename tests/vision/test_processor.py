"""The image processor and the span layout against the reference's own outputs (vision golden §1): exact."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from dsv41_jax import config as C
from dsv41_jax.vision import expand_prompt, image_token_types, plan_image_grid, process_image
from dsv41_jax.vision.processor import decode_rgb
from dsv41_jax.vision.prompt import spans_of

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vis(golden_dir):
    return C.from_hf(golden_dir / "tiny_hf").vision, np.load(golden_dir / "vision_inputs.npz")


def test_resize_planner_table(vis):
    """Upscale, multiple-of-14 rounding, the 1024-token cap and its very-tall / very-wide branches."""
    cfg, inputs = vis
    for w, h, *expected in inputs["plan_table"].tolist():
        p = plan_image_grid(w, h, cfg)
        assert [p.n_llm_h, p.n_llm_w, p.height, p.width, *p.vit_grid(cfg.patch_size), p.span_len] == expected, (w, h)
        assert p.span_len <= cfg.max_n_token


@pytest.mark.parametrize("k", [0, 1])
def test_png_to_patches_bit_exact(vis, golden_dir, k):
    cfg, inputs = vis
    png = golden_dir / f"vision_image_{k}.png"
    assert np.array_equal(decode_rgb(png), inputs[f"img{k}_rgb"])
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    for source in (png, url, png.read_bytes(), inputs[f"img{k}_rgb"]):
        im = process_image(source, cfg)
        n_vit_h, n_vit_w, n_llm_h, n_llm_w, h, w = inputs[f"img{k}_grid"].tolist()
        assert (im.n_vit_h, im.n_vit_w, im.n_llm_h, im.n_llm_w) == (n_vit_h, n_vit_w, n_llm_h, n_llm_w)
        assert im.patches.shape == (n_vit_h * n_vit_w, 3, 14, 14) and (h, w) == (n_vit_h * 14, n_vit_w * 14)
        assert np.array_equal(im.patches.astype(np.float32), inputs[f"img{k}_patches"])  # bf16 values, exact
    assert np.array_equal(image_token_types(n_llm_h, n_llm_w), inputs[f"img{k}_types"])


def test_prompt_expansion_gives_the_reference_layout(vis):
    """The prompt's two placeholders expanded per row (row 0: images 0, 1; row 1: images 1, 0)."""
    _, inputs = vis
    grids = [tuple(inputs[f"img{k}_grid"][2:4].tolist()) for k in (0, 1)]
    for b in range(2):
        e = expand_prompt(inputs["prompt_ids"], grids, int(inputs["image_token_id"]), inputs["row_images"][b])
        assert np.array_equal(e.ids, inputs["input_ids"][b]) and np.array_equal(e.token_types, inputs["token_types"][b])
        assert [s.start for s in e.spans] == inputs["image_starts"][b].tolist()
        assert [s.length for s in e.spans] == inputs["image_span_lens"][b].tolist()
        assert [(s.start, s.length) for s in e.spans] == spans_of(e.token_types)


def test_bad_images_and_prompts_are_named(vis, tmp_path):
    cfg, inputs = vis
    with pytest.raises(ValueError, match="2 image placeholder.*1 image"):
        expand_prompt(inputs["prompt_ids"], [(2, 2)], 3)
    (tmp_path / "x.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="x.png: cannot decode"):
        process_image(tmp_path / "x.png", cfg)
    with pytest.raises(FileNotFoundError, match="nope.png"):
        process_image(tmp_path / "nope.png", cfg)
    with pytest.raises(ValueError, match="only base64"):
        process_image("data:image/png,abc", cfg)
    with pytest.raises(ValueError, match="uint8 \\[H, W, 3\\]"):
        process_image(np.zeros((4, 4), np.uint8), cfg)
