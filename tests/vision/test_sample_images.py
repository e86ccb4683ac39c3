"""``dsv41 sample --image``: the placeholder in the text, and bad images or counts as one error line (exit 2)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from dsv41_jax.cli import main
from dsv41_jax.sample import encode_prompts
from dsv41_jax.testing import GOLDEN

pytest.importorskip("PIL")
HF = str(GOLDEN / "tiny_hf")
PNG = str(GOLDEN / "vision_image_0.png")


def test_placeholder_becomes_the_image_token():
    tok = Tokenizer.from_file(str(GOLDEN / "tiny_hf" / "tokenizer.json"))
    plain = encode_prompts(tok, 0, ["a cat", "on a mat"])
    got = encode_prompts(tok, 0, ["<image>a cat<image>on a mat", "<｜deepseek_image｜>"], image_token_id=3)
    assert got[0] == [0, 3, *plain[0][1:], 3, *plain[1][1:]]
    assert got[1] == [0, 3]  # the tokenizer's own spelling of the placeholder is the same token
    assert encode_prompts(tok, 0, ["<image>"]) != [[0, 3]]  # without images it is plain text


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "no placeholder", "--image", PNG], "--image: the prompts hold 0 image placeholder(s) but 1"),
    (["--prompt", "<image> <image>", "--image", PNG], "--image: the prompts hold 2 image placeholder(s) but 1"),
    (["--prompt", "<image>", "--image", "/nonexistent.png"], "--image: image /nonexistent.png: no such file"),
    (["--prompt", "<image>", "--image", HF + "/config.json"], "config.json: cannot decode"),
])
def test_bad_images_are_one_line(capsys, argv, message):
    got = main(["sample", "--hf-dir", HF, "--dtype", "fp32", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert got == 2 and message in err[-1], err
