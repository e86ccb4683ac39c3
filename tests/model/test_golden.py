"""The backbone against the official reference implementation's fp32 outputs on the golden checkpoint.

Tolerances follow the golden README's recipe (§7): a correct fp32 port sits at ~1e-7..1e-6 relative
(summation order); one QDQ boundary flip can push a single row to ~1e-3. Every discrete decision
(top-k, candidate blocks, expert routes, Engram rows) of ``ref_fp32`` has a relative margin ≥ 3e-5,
far above our ~1e-6 error, so they must all be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv41_jax.checkpoint.load import model_from_hf
from dsv41_jax.scoring import compare, prefill_outputs, row_rel_l2
from dsv41_jax.testing import CPU_EXACT


@pytest.fixture(scope="module")
def golden(golden_dir):
    model, hasher = model_from_hf(golden_dir / "tiny_hf")
    inputs = np.load(golden_dir / "inputs.npz")
    ref = dict(np.load(golden_dir / "ref_fp32.npz"))
    ours = {}
    for tag in ("batch1", "batch2"):
        ours |= prefill_outputs(model, hasher, inputs[f"{tag}_ids"], tag, layers_detail=tag == "batch1")
    return ours, ref


@CPU_EXACT
def test_prefill_logits_match_reference(golden):
    ours, ref = golden
    errs = np.concatenate([row_rel_l2(ours[k], ref[k]) for k in ("batch1_prefill_logits", "batch2_prefill_logits")])
    assert errs.size == 481
    assert np.median(errs) < 2e-6, np.median(errs)
    # the tail: a value on a QDQ rounding boundary moves the rows after it (golden README §7: correct
    # re-roundings of the reference reach q90 8.6e-5); on different CPUs we measured q90 5.3e-7 and 5.5e-6
    assert np.quantile(errs, 0.9) < 1e-4
    assert errs.max() < 1e-3  # at most a rare QDQ-boundary flip (golden README §7)
    for k in ("batch1_prefill_logits", "batch2_prefill_logits"):
        assert (ours[k].argmax(-1) == ref[k].argmax(-1)).all()


@CPU_EXACT
def test_every_discrete_decision_matches(golden):
    ours, ref = golden
    report = compare(ours, ref)
    discrete = {k: r for k, r in report.items() if "row_agreement" in r}
    names = {k.split("_", 1)[1].rsplit("_", 1)[0] for k in discrete}
    assert {"topk", "candidates", "moe", "engram_row"} <= names, sorted(discrete)
    assert all(r["row_agreement"] == 1.0 for r in discrete.values()), discrete


@CPU_EXACT
def test_streams_and_caches_layer_by_layer(golden):
    ours, ref = golden
    streams = ours["b1_stream_after_layer"]
    for layer in range(streams.shape[0]):
        e = row_rel_l2(streams[layer].reshape(161, -1), ref["b1_stream_after_layer"][layer].reshape(161, -1))
        assert np.median(e) < 2e-6 and e.max() < 1e-3, (layer, np.median(e), e.max())  # one-flip bound, §7
    for key in ("b1_pre_mix_after_layer", "b1_main_hidden", "b1_compressed_kv_2", "b1_compressed_kv_4",
                "b1_compressed_kv_6", "b1_index_k_2", "b1_index_k_4", "b1_index_k_6"):
        e = row_rel_l2(ours[key], ref[key])
        assert np.median(e) < 1e-5 and e.max() < 1e-3, (key, np.median(e), e.max())


def test_bf16_activations_within_the_references_own_bf16_spread(golden_dir):
    """bf16 activations move the tiny model's logits by about as much as the reference's own bf16 numerics.

    The golden README (§7) measures the reference's native bf16/FP8 run against its fp32 run at a prefill
    median row error of 0.26 and argmax agreement 0.64: bf16 roundings feed the QDQ and top-k decisions of
    this tiny random model chaotically. Our bf16 path must sit inside that spread, against both references.
    """
    model, hasher = model_from_hf(golden_dir / "tiny_hf", dtype="bfloat16")
    ids = np.load(golden_dir / "inputs.npz")["batch2_ids"]
    ours = prefill_outputs(model, hasher, ids, "batch2")["batch2_prefill_logits"]
    for ref_file in ("ref_fp32.npz", "ref_native.npz"):
        ref = np.load(golden_dir / ref_file)["batch2_prefill_logits"]
        err = row_rel_l2(ours, ref)
        assert np.median(err) < 0.3 and (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.6, (ref_file, np.median(err))
