"""Speculative decoding with the DSpark drafter: the same tokens as plain decoding, exact cache rollback, and
rejection sampling that keeps the target's distribution.

One generator on the 8-layer tiny model (random weights, every layer role) with CED prefill and ragged
prompts serves every engine test: its plain decode block is the reference, its speculative block runs with
two drafters of the same shapes (the random one, whose drafts are nearly always rejected, and one whose Markov
head holds the bigrams of the reference output, so whole blocks are accepted); the drafter's weights are an
argument of the compiled block, so both share one compilation. Verify lengths are scheduled from a
steps-per-second table (also an argument) over two compiled chunk widths, 2 and K + 1: a flat table verifies
every draft (the widest chunk, as fixed K), a steep one a single draft per request (the narrow chunk).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import cache as C
from dsv41_jax.engine.sampling import Generator, SamplingConfig
from dsv41_jax.engine.speculative import (
    accept_greedy,
    accept_sampled,
    profile_sps,
    rollback,
    schedule_verify,
    sps_by_tokens,
)
from dsv41_jax.engram_device import device_engram
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.model.dspark import DSpark
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.testing import bigram_drafter

K = 4  # drafts verified per step: a verify chunk of 5 ≤ window 8
NEW = 12
FLAT = (1.0,) * (3 * (K + 1) + 1)  # steps per second at n verified tokens: flat, so every draft is verified


@pytest.fixture(scope="module")
def spec(tiny8_cfg):
    # a one-stage drafter (first and last stage in one: main_proj and the heads) keeps the compile short; the
    # three stages are the golden test's (tests/model/test_dspark.py)
    a = tiny8_cfg.attention
    cfg = tiny8_cfg.replace(dspark=dataclasses.replace(tiny8_cfg.dspark, n_layers=1),
                            attention=dataclasses.replace(a, compress_ratios=a.compress_ratios[:9]))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    drafter = DSpark(cfg, rngs=nnx.Rngs(1))
    tables = device_engram(EngramHasher(cfg.engram, np.arange(cfg.vocab_size) % cfg.engram.compressed_vocab_size))
    sampling = SamplingConfig(temperature=0, max_new_tokens=NEW, stop_tokens=(), block=1, prefill_chunk=16,
                              prefill_mode="ced", speculative=K, sps=FLAT, verify_widths=(2, K + 1))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(4, 500, n)) for n in (16, 7, 12)]  # ragged; CED narrows the 16-token prompt
    gen = Generator(model, tables, len(prompts), 64, sampling, drafter=drafter)
    plain = gen.generate(prompts, speculative=False)
    return dict(gen=gen, drafter=drafter, prompts=prompts, plain=plain, cfg=cfg, model=model)


def emitted_per_step(gen: Generator, prompts, n_steps: int) -> tuple[np.ndarray, list]:
    """Tokens emitted by each of the first speculative steps [steps, B], and the states before and after each."""
    s = gen.start_speculative(gen.prefill(prompts))
    counts, states = [], [s]
    for _ in range(n_steps):
        s, out = gen.speculative_block(s)
        counts.append((out >= 0).sum(-1))
        states.append(s)
    return np.array(counts), states


def test_greedy_speculative_equals_plain_decoding(spec):
    """Random drafts (rejected), then bigram drafts (whole blocks accepted, one bigram left out so a block is
    cut short): the emitted tokens are plain greedy decoding's, token for token, in every ragged row."""
    gen, plain = spec["gen"], spec["plain"]
    assert all(len(row) == NEW for row in plain)
    random_state = gen.dstate
    try:
        assert gen.generate(spec["prompts"]) == plain
        assert (gen.stats["steps"] >= NEW // 2).all()  # mostly rejected: about one token per step
        np.testing.assert_array_equal(gen.stats["rows"], (K + 1) * gen.stats["steps"])  # the widest chunk
        gen.dstate = bigram_drafter(spec["drafter"], plain, skip={(plain[0][2], plain[0][3])})
        assert gen.generate(spec["prompts"]) == plain
        per_step, _ = emitted_per_step(gen, spec["prompts"], 3)
        assert (per_step == K + 1).any(), per_step  # a fully accepted block: K drafts and the bonus token
        assert per_step[0, 0] == 3, per_step  # row 0: anchor + 2 drafts, then the left-out bigram is rejected
        assert gen.stats["accepted"].sum() > 0
    finally:
        gen.dstate = random_state


def test_scheduled_narrow_verify_chunks_keep_greedy_output(spec):
    """With steps per second halving per verified token, the scheduler verifies no draft beyond the pending
    token (a token gains at most 1 expected token, never the batch's whole rate); the step then runs the
    compiled width-2 chunk and every request verifies one draft in it. Bigram drafts (one left out) are accepted
    and rejected there, and the output is still plain greedy decoding's, token for token."""
    gen, plain = spec["gen"], spec["plain"]
    random_state = gen.dstate
    try:
        gen.dstate = bigram_drafter(spec["drafter"], plain, skip={(plain[0][2], plain[0][3])})
        gen.sps = jnp.asarray(0.5 ** np.arange(len(FLAT)), jnp.float32)
        assert gen.generate(spec["prompts"]) == plain
        st = gen.stats
        np.testing.assert_array_equal(st["rows"], 2 * st["steps"])  # every step at width 2 ...
        np.testing.assert_array_equal(st["drafted"], st["steps"])  # ... verifying one draft
        assert 0 < st["accepted"].sum() < st["drafted"].sum(), st
    finally:
        gen.dstate, gen.sps = random_state, jnp.asarray(FLAT, jnp.float32)


def test_cache_after_a_rejection_equals_plain_decoding(spec):
    """After one speculative step that rejected a draft, every row's cache (main KV, index keys, SWA rings,
    ratio-2 carry, Engram history) equals plain decoding's after the same tokens; entries past the kept
    positions hold what they held before the verify chunk."""
    gen, plain, prompts = spec["gen"], spec["plain"], spec["prompts"]
    random_state = gen.dstate
    try:
        gen.dstate = bigram_drafter(spec["drafter"], plain, skip={(plain[0][2], plain[0][3])})
        counts, states = emitted_per_step(gen, prompts, 1)
    finally:
        gen.dstate = random_state
    n = counts[0]
    assert n[0] == 3 and (n >= 1).all(), n
    spec_cache, spec_state = states[1].cache, states[1]
    # the drafter's rings observed every kept position, and only those
    before, after = states[0].draft, spec_state.draft
    np.testing.assert_array_equal(after.lengths, spec_cache.lengths)
    w = spec["cfg"].attention.window_size
    for i in range(3):
        kept = (int(before.lengths[i]) + np.arange(n[i])) % w
        for rb, ra in zip(before.rings, after.rings, strict=True):
            vb, va = np.asarray(rb.values[i]).view(np.uint8), np.asarray(ra.values[i]).view(np.uint8)
            others = np.setdiff1d(np.arange(w), kept)
            np.testing.assert_array_equal(va[others], vb[others])
            assert all((va[j] != vb[j]).any() for j in kept)
    s = gen.prefill(prompts)
    for t in range(1, int(n.max()) + 1):
        s, _ = gen.decode_block(s)
        for i in np.flatnonzero(n == t):
            assert_row_equal(spec["cfg"], spec_cache, s.cache, i)
            np.testing.assert_array_equal(np.asarray(spec_state.history[i]), np.asarray(s.history[i]))
            assert int(spec_state.n_seen[i]) == int(s.n_seen[i])


def assert_row_equal(cfg, got: C.Cache, want: C.Cache, i: int) -> None:
    assert int(got.lengths[i]) == int(want.lengths[i])
    length = int(want.lengths[i])
    for ring_got, ring_want in zip(got.rings, want.rings, strict=True):
        close(C.read_ring(ring_got, jnp.float32)[i], C.read_ring(ring_want, jnp.float32)[i])
    a = cfg.attention
    for layer, sg, sw in zip(a.kv_source_layers, got.sources, want.sources, strict=True):
        m = a.compress_ratios[layer]
        for x, y in zip(sg[:4], sw[:4], strict=True):
            x, y = np.asarray(x[i]).view(np.uint8), np.asarray(y[i]).view(np.uint8)
            # written entries agree (packed bytes; a chunk of 5 and single steps round alike here); past
            # the kept positions both hold the bytes from before (zeros): the rollback restored them
            np.testing.assert_array_equal(x[length // m:], y[length // m:])
            assert (x[: length // m] == y[: length // m]).mean() > 0.999
        if m > 1 and length % 2:  # an open group: its first token's compressor carry
            close(sg.carry_c[i], sw.carry_c[i])
            close(sg.carry_z[i], sw.carry_z[i])


def close(x, y) -> None:
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-4, atol=1e-5)


def test_rollback_of_nothing_kept_restores_the_cache(spec):
    """Cut back to zero kept rows, a fed chunk leaves the cache exactly as it was (every byte)."""
    gen, cfg = spec["gen"], spec["cfg"]
    s = gen.prefill(spec["prompts"])
    before = s.cache
    spec_state = gen.start_speculative(s)
    after, _ = gen.speculative_block(spec_state)
    a = cfg.attention
    unused = {layer: (jnp.ones((3, K + 1, a.head_dim)),) * 2 for layer in a.kv_source_layers
              if a.compress_ratios[layer] == 2}  # no row kept: no row's carry is read
    restored = jax.jit(lambda b, a: rollback(cfg, b, a, K + 1, jnp.zeros((3,), jnp.int32), unused))(before,
                                                                                                  after.cache)
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def test_greedy_acceptance_rule():
    logits = jax.nn.one_hot(jnp.array([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]]), 10)
    drafts = jnp.array([[3, 1, 0, 1], [2, 7, 1, 8]])
    accepted, nxt = accept_greedy(logits, drafts, jnp.array([4, 3]))
    np.testing.assert_array_equal(accepted, [2, 3])  # row 0 mismatches at draft 3; row 1 verifies only 3
    np.testing.assert_array_equal(nxt, [4, 8])  # the correction, and the bonus after full acceptance


def test_rejection_sampling_keeps_the_target_distribution():
    """20k draws with fixed keys: drafts y ~ q, accept/resample; the first emitted token follows p_0, and the
    second (when the first draft was accepted) p_1. Pearson χ² against the target is far below its 99.99%
    quantile, while the drafts themselves are far from it (the test can tell)."""
    v, k, n = 8, 3, 20_000
    rng = np.random.default_rng(0)
    p = jax.nn.softmax(jnp.asarray(rng.normal(size=(k + 1, v)) * 1.5, jnp.float32), -1)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(k, v)) * 1.5, jnp.float32), -1)

    @jax.jit
    def draw(keys):
        drafts = jax.vmap(lambda key: jax.random.categorical(key, jnp.log(q)))(keys[:, 0]).astype(jnp.int32)
        return drafts, *accept_sampled(keys[:, 1], jnp.broadcast_to(p, (n, k + 1, v)),
                                       jnp.broadcast_to(q, (n, k, v)), drafts, jnp.full((n,), k, jnp.int32))

    drafts, accepted, nxt = draw(jax.random.split(jax.random.key(0), 2 * n).reshape(n, 2))
    accepted, nxt, drafts, p, q = map(np.asarray, (accepted, nxt, drafts, p, q))
    first = np.where(accepted >= 1, drafts[:, 0], nxt)
    second = np.where(accepted >= 2, drafts[:, 1], nxt)[accepted >= 1]
    bound = 29.88  # χ²(7) at 0.9999
    assert chi2(first, p[0]) < bound and chi2(second, p[1]) < bound, (chi2(first, p[0]), chi2(second, p[1]))
    assert chi2(drafts[:, 0], p[0]) > 100 * bound
    assert 0 < (accepted == k).mean() < 1 and (accepted == 0).mean() > 0


def chi2(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=probs.size)
    expected = probs * samples.size
    return float(((counts - expected) ** 2 / expected).sum())


def test_bad_speculative_settings(spec):
    import argparse

    from dsv41_jax import cli_args

    assert cli_args.speculative("dspark") == 0 and cli_args.speculative("dspark:3") == 3
    for bad in ("eagle", "dspark:0", "dspark:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="dspark:K"):
            cli_args.speculative(bad)
    gen = spec["gen"]
    model = Transformer(spec["cfg"], rngs=nnx.Rngs(0))
    sampling = dataclasses.replace(gen.sampling, speculative=2)
    with pytest.raises(ValueError, match="drafter"):
        Generator(model, gen.tables, 3, 64, sampling)
    with pytest.raises(ValueError, match="drafts per step"):
        Generator(model, gen.tables, 3, 64, dataclasses.replace(sampling, speculative=6), drafter=spec["drafter"])
    with pytest.raises(ValueError, match=r"verify widths \(0, 3\)"):  # k + 1 = 3
        Generator(model, gen.tables, 3, 64, dataclasses.replace(sampling, verify_widths=(0, 3)),
                  drafter=spec["drafter"])


def test_confidence_schedule_is_the_best_prefix_choice():
    """Against every prefix-contiguous choice of verify lengths: the scheduler's choice reaches the largest
    (B + Σ survival) · SPS(B + X), and a flat curve verifies every draft, a steep one none."""
    import itertools

    rng = np.random.default_rng(3)
    conf = jnp.asarray(rng.normal(size=(3, 4)) * 2, jnp.float32)
    surv = np.cumprod(1 / (1 + np.exp(-np.asarray(conf))), -1)
    live = jnp.array([True, False, True])
    sps = jnp.asarray(100.0 / (1 + 0.15 * np.arange(16) ** 1.5), jnp.float32)  # slower with more tokens

    def objective(lengths):
        gain = sum(surv[b, :n].sum() for b, n in enumerate(lengths) if live[b])
        x = sum(n for b, n in enumerate(lengths) if live[b])
        return (2 + gain) * float(sps[min(2 + x, 15)])

    got = np.asarray(schedule_verify(conf, live, sps))
    best = max(objective(c) for c in itertools.product(range(5), [0], range(5)))
    assert got[1] == 0 and objective(got) == pytest.approx(best, rel=1e-6), (got, objective(got), best)
    assert 0 < got.sum() < 8  # the curve binds: neither every draft nor none
    np.testing.assert_array_equal(schedule_verify(conf, live, jnp.ones((16,))), [4, 0, 4])
    np.testing.assert_array_equal(schedule_verify(conf, live, jnp.array([1.0, 1.0, 1.0, 0.01])), [0, 0, 0])


def test_sps_table_charges_the_compiled_width():
    # 2 requests, compiled widths 1, 2, 5: n verified tokens run ⌈n / 2⌉ rows per request, rounded up to a width
    got = sps_by_tokens(2, (1, 2, 5), (30.0, 20.0, 10.0))
    assert got == [30.0, 30.0, 30.0, 20.0, 20.0] + [10.0] * 6


def test_profile_sps_measures_the_compiled_widths(spec):
    # only the widths given are measured (one: K + 1 = 4, the shape of the 4-token context's prefill, so the
    # profile compiles one program); every token count is charged that width's rate
    model, tables = spec["model"], spec["gen"].tables
    table = profile_sps(model, tables, 2, 3, widths=(4,), context=4, repeats=1)
    assert table["widths"] == [4] and len(table["steps_per_s"]) == 1 and table["steps_per_s"][0] > 0
    assert table["sps"] == table["steps_per_s"] * (2 * 4 + 1)
    with pytest.raises(ValueError, match="must be one of them"):
        profile_sps(model, tables, 2, 3, widths=(1, 2))
