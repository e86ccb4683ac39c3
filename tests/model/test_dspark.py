"""The DSpark drafter against the official reference's ``forward_spec`` outputs on the golden checkpoint.

The golden decode protocol (golden README §2, §6): prefill, then 8 teacher-forced decode steps through the
engine's packed cache; after each the drafter drafts 5 tokens with the golden's next id as the anchor. The
prefill runs in chunks of 16 tokens and the decode steps are padded to 16 rows, so that prefill and decode
share one compiled step (chunked prefill is exact, tests/engine/test_engine.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dsv41_jax.checkpoint.load import drafter_from_hf, model_from_hf
from dsv41_jax.scoring import decode_outputs, row_rel_l2
from dsv41_jax.testing import CPU_EXACT


@pytest.fixture(scope="module")
def decoded(golden_dir):
    model, hasher = model_from_hf(golden_dir / "tiny_hf")
    drafter = drafter_from_hf(golden_dir / "tiny_hf", model.cfg)
    ref = dict(np.load(golden_dir / "ref_fp32.npz"))
    ids = np.load(golden_dir / "inputs.npz")["batch2_ids"]
    ours = decode_outputs(model, hasher, drafter, ids, ref["batch2_decode_input_ids"], ref["batch2_decode_next_ids"],
                          "batch2", prefill_chunk=16)
    return ours, ref


@CPU_EXACT
def test_drafts_match_the_reference(decoded):
    ours, ref = decoded
    assert (ours["batch2_dspark_draft_ids"] == ref["batch2_dspark_draft_ids"]).all()
    e = row_rel_l2(ours["batch2_dspark_logits"], ref["batch2_dspark_logits"])
    assert e.size == 80 and np.median(e) < 2e-6 and e.max() < 1e-3, (np.median(e), e.max())  # golden README §7
    conf, want = ours["batch2_dspark_confidence"], ref["batch2_dspark_confidence"]
    assert np.abs(conf - want).max() < 1e-4 * np.abs(want).max(), np.abs(conf - want).max()


@CPU_EXACT
def test_decode_protocol_matches_the_reference(decoded):
    ours, ref = decoded
    e = row_rel_l2(ours["batch2_decode_logits"], ref["batch2_decode_logits"])
    assert np.median(e) < 2e-6 and e.max() < 1e-3, (np.median(e), e.max())
    assert (ours["batch2_decode_engram_row_ids"] == ref["batch2_decode_engram_row_ids"]).all()
    assert (np.sort(ours["batch2_decode_topk"], -1) == np.sort(ref["batch2_decode_topk"], -1)).all()


def test_check_golden_judges_the_written_file(decoded, golden_dir, tmp_path):
    """The arrays under the golden's names pass the golden's own scorer (robust recipe, fp32)."""
    ours, _ = decoded
    np.savez(tmp_path / "ours.npz", **ours)
    out = subprocess.run([sys.executable, str(golden_dir / "check_golden.py"), str(golden_dir / "ref_fp32.npz"),
                          str(tmp_path / "ours.npz"), "--json"], capture_output=True, text=True, check=True).stdout
    res = json.loads(out)
    assert set(res["groups"]) == {"decode_logits", "dspark_logits"}
    assert res["checks"]["robust"], res


def test_score_finds_the_decode_protocol_of_each_tag(golden_dir, tmp_path):
    from dsv41_jax.checkpoint.load import CheckpointUnreadable, load_drafter
    from dsv41_jax.scoring import input_tags

    files = ["batch1_ids", "batch2_ids", "batch1_decode_input_ids", "batch1_decode_next_ids", "engram_token_map"]
    assert input_tags(files) == {"batch1": ("batch1_decode_input_ids", "batch1_decode_next_ids"), "batch2": ()}
    with pytest.raises(ValueError, match="needs both"):
        input_tags(["batch1_ids", "batch1_decode_input_ids"])
    with pytest.raises(ValueError, match="no '<tag>_ids'"):
        input_tags(["batch1_decode_input_ids", "batch1_decode_next_ids"])
    model, _ = model_from_hf(golden_dir / "tiny_hf")
    with pytest.raises(CheckpointUnreadable, match="DSpark drafter"):
        load_drafter(model.cfg, hf_dir=tmp_path)
