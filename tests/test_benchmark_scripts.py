"""The benchmark scripts' own alternatives compute what they are compared with (they run on the device; here
only their math, on CPU, at tiny shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_entry_points import REPO, load_script


def test_gather_vjp_variants_agree():
    """The three backwards of the top-k gather timed by benchmarks/gather_vjp.py: the fp32 scatter and the sorted
    fp32 scatter are the exact sum rounded once; the autodiff scatter in bf16 rounds at every collision."""
    bench = load_script("benchmarks/gather_vjp.py")
    rng = np.random.default_rng(0)
    s, k, t, h = 64, 16, 32, 8
    visible = np.maximum((np.arange(s) + 1) // 2, 1)[None, :, None]
    idx = jnp.asarray((rng.random((1, s, k)) * visible).astype(np.int32))
    for dtype in (jnp.float32, jnp.bfloat16):
        kv = jnp.asarray(rng.standard_normal((1, t, h)), dtype)
        g = jnp.asarray(rng.standard_normal((1, s, k, h)), dtype)
        want = np.zeros((t, h))
        np.add.at(want, np.asarray(idx)[0], np.asarray(g.astype(jnp.float32))[0])
        out = {name: np.asarray(jax.jit(fn)(kv, idx, g).astype(jnp.float32))[0]
               for name, fn in bench.variants().items()}
        exact = np.asarray(jnp.asarray(want, dtype).astype(jnp.float32))  # the float64 sum, rounded once
        tol = dict(rtol=1e-6, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2**-8, atol=2**-8)
        for name in ("fp32", "sorted_fp32"):
            np.testing.assert_allclose(out[name], exact, **tol, err_msg=name)
        if dtype == jnp.float32:
            np.testing.assert_allclose(out["autodiff_bf16"], exact, **tol)
        else:  # rounding at every collision is worse than rounding once
            assert np.abs(out["autodiff_bf16"] - exact).max() > 4 * np.abs(out["fp32"] - exact).max()


def _program_reads(step, state, *args) -> dict[str, int]:
    """Bytes that ``step``'s jaxpr reads from each leaf of ``state`` (its first argument), by dotted name: a
    take, gather or slice reads its output's bytes, a leaf that nothing uses none, any other use all of it
    (capped at the leaf's size)."""
    jaxpr = jax.make_jaxpr(step)(state, *args).jaxpr
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    partial = {"_take", "gather", "slice", "dynamic_slice"}
    reads = {}
    for (path, leaf), var in zip(leaves, jaxpr.invars, strict=False):
        nbytes = leaf.size * leaf.dtype.itemsize
        used = [e for e in jaxpr.eqns if any(v is var for v in e.invars)]
        got = sum(e.outvars[0].aval.size * e.outvars[0].aval.dtype.itemsize
                  if e.params.get("name", e.primitive.name) in partial else nbytes for e in used)
        reads[".".join(str(getattr(k, "key", k)) for k in path)] = min(got, nbytes)
    return reads


@pytest.mark.parametrize("weights", ["float", "native"])
def test_decode_floor_counts_what_a_decode_step_reads(weights):
    """engine_bench's bytes-per-decode-step floor on the tiny model against independent counts: its weight
    part against what the traced decode step (batch 1, the gathered experts) reads from each parameter, at
    the stored precision (FP8 / MXFP4 codes and E8M0 scales when native); its cache part against the bytes
    of the packed cache arrays allocated at that context and the attention layers' own KV and top-k sources."""
    from flax import nnx

    from dsv41_jax import cache as C
    from dsv41_jax import config as Cfg
    from dsv41_jax.engine.step import forward_chunk
    from dsv41_jax.model.transformer import abstract_model

    bench = load_script("benchmarks/engine_bench.py")
    cfg = Cfg.tiny().replace(weight_format=weights)
    model = abstract_model(cfg)
    graphdef, state = nnx.split(model)
    ctx = 64  # 32 entries in ratio-2 sources, 64 in ratio-1: top-k 16 and the 32-entry pool bind
    cache = jax.eval_shape(lambda: C.init_cache(cfg, 1, ctx))
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    rows = jax.ShapeDtypeStruct((1, 1, len(cfg.engram.layer_ids), cfg.engram.n_columns), jnp.int32)
    step = lambda st, c, t, r: forward_chunk(nnx.merge(graphdef, st), c, t, r, jnp.ones((1,), jnp.int32))  # noqa: E731
    reads = _program_reads(step, state, cache, tokens, rows)
    got = bench.weight_reads(cfg, 1)
    experts = sum(v for k, v in reads.items() if ".ffn.experts." in k)
    assert experts == got["routed_experts"] > 0  # K of E experts per layer, codes and scales when native
    assert sum(reads.values()) == sum(got.values())

    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    entry = {id(s): nbytes(s.kv_codes) + nbytes(s.kv_scales) for s in cache.sources}
    src = {layer: s for layer, s in zip(cfg.attention.kv_source_layers, cache.sources, strict=True)}
    pairs = {(b.attn.spec.kv_source, b.attn.spec.topk_source) for b in model.layers if b.attn.spec.compressed}
    attended = sum(cfg.attention.index_topk * entry[id(src[kv])] // src[kv].kv_codes.shape[1] for kv, _ in pairs)
    want = {"swa_rings": nbytes(cache.rings), "index_keys": sum(nbytes((s.ik_codes, s.ik_exps)) for s in cache.sources),
            "compressor_carry": sum(nbytes((s.carry_c, s.carry_z)) for s in cache.sources),
            "attended_entries": attended}
    assert bench.cache_reads(cfg, 1, ctx) == want
    assert bench.cache_reads(cfg, 3, ctx) == {k: 3 * v for k, v in want.items()}
    # batch: K distinct experts at 1, all E in the limit; one embedding row per sequence
    assert bench.expected_experts(8, 2, 1) == 2 and abs(bench.expected_experts(8, 2, 200) - 8) < 1e-9
    assert bench.weight_reads(cfg, 4)["embedding_rows"] == 4 * got["embedding_rows"]


def test_charts_draw_the_tables_numbers_and_nothing_else(tmp_path):
    """benchmarks/charts.py: every table of BENCHMARKS.md read, each chart's bars the numbers of its table's cells
    (a cell that is not a number draws none), one PNG per table with numbers and an index of them."""
    charts = load_script("benchmarks/charts.py")
    md = ("## Decode\n\n| batch | context | step (ms) | tokens/s | note |\n|---:|---:|---:|---|---|\n"
          "| 1 | 8,192 | 29.5 | 33.9 | a |\n| 32 | 65,536 | not yet measured | 1,079 | b |\n\ntext\n")
    (table,) = charts.tables(md)
    labels, cols = charts.series(table)
    assert table.heading == "Decode" and labels == ["1 / 8,192", "32 / 65,536"]
    assert list(cols) == ["tokens/s"] and cols["tokens/s"] == [33.9, 1079.0]  # one number is not a column
    every = charts.tables((REPO / "BENCHMARKS.md").read_text())  # the real file parses: every row fits its header
    assert len(every) >= 20 and all(len(r) <= len(t.header) for t in every for r in t.rows)
    assert sum(bool(charts.series(t)[1]) for t in every) >= 20  # most tables hold numbers to draw
    (tmp_path / "b.md").write_text(md + "\n## Words only\n\n| a | b |\n|---|---|\n| x | y |\n")
    assert charts.main(["--md", str(tmp_path / "b.md"), "--out", str(tmp_path / "out")]) == 0
    (png,) = (tmp_path / "out").glob("*.png")  # the table without numbers draws nothing
    assert png.name == "00-decode.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "- Decode: ![](00-decode.png)" in (tmp_path / "out" / "index.md").read_text()


def test_profile_split_attributes_kernels_and_lists_the_largest():
    """profile_split.py on a hand-written HLO and trace: a kernel takes its instruction's scope, a fusion without
    one its members' majority, a CUDA-graph replay ('.' spelt '_') its instruction's, a library kernel the scope
    in its event, a Pallas kernel (named after itself, ``__N`` where repeated) its custom calls'; the top list
    orders kernels by time with calls and scope per step."""
    split = load_script("benchmarks/profile_split.py")
    hlo = "\n".join([
        "%fused_computation.1 (p: f32[4]) -> f32[4] {",
        '  %a = f32[4] add(p, p), metadata={op_name="jit(step)/mhc/add"}',
        '  ROOT %m = f32[4] multiply(a, a), metadata={op_name="jit(step)/mhc/mul"}',
        "}",
        "ENTRY %main (x: f32[4]) -> f32[4] {",
        "  %fusion.1 = f32[4] fusion(x), kind=kLoop, calls=%fused_computation.1",
        '  %dot.2 = f32[4] dot(x, x), metadata={op_name="jit(step)/attention/bqsnh,bqskh->bqsnk/dot_general"}',
        # Pallas calls: the kernel replays under the Triton kernel's name, not the instruction's
        '  %custom-call.7 = f32[4] custom-call(x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name='
        '"jit(step)/moe/pallas_call"}, backend_config={"name":"grouped_rows_matmul","ir":"ML\\EFR","num_warps":4}',
        '  %custom-call.8 = f32[4] custom-call(x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name='
        '"jit(step)/transpose(jvp())/moe/pallas_call"}, backend_config="{\\"name\\":\\"grouped_rows_matmul\\"}"',
        "}",
    ])
    stream = {"pid": 1, "tid": 7}
    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #14(Compute)"}},
        *[{"ph": "X", "name": "fusion_1", "dur": 10.0, "args": {"hlo_op": "command_buffer.3"}, **stream}] * 4,
        {"ph": "X", "name": "dot.2", "dur": 50.0, "args": {"hlo_op": "dot.2"}, **stream},
        {"ph": "X", "name": "nvjet_gemm", "dur": 30.0,
         "args": {"hlo_op": "command_buffer.3", "name": "jit(step)/optimizer/dot_general"}, **stream},
        {"ph": "X", "name": "memcpy", "dur": 5.0, "args": {"hlo_op": "command_buffer.3"}, **stream},
        {"ph": "X", "name": "grouped_rows_matmul__2", "dur": 7.0, "args": {"hlo_op": "command_buffer.3"}, **stream},
        {"ph": "X", "name": "grouped_rows_matmul", "dur": 1.0, "args": {"hlo_op": "command_buffer.3"}, **stream},
    ]}
    parts = split.hlo_parts(hlo)
    times, unmatched, n = split.kernel_parts(trace, parts)
    assert times == {"mhc": 40.0, "attention": 50.0, "optimizer": 30.0, "moe": 8.0, "other": 5.0}
    assert unmatched == 5.0 and n == 6
    top = split.top_kernels(trace, parts, split.hlo_scopes(hlo), 3, steps=2)
    assert [(r["kernel"], r["part"], r["ms_per_step"], r["calls_per_step"]) for r in top] == [
        ("dot.2", "attention", 0.025, 0.5), ("fusion_1", "mhc", 0.02, 2.0), ("nvjet_gemm", "optimizer", 0.015, 0.5)]
    assert top[1]["scope"] == "jit(step)/mhc/add" and "bqsnh" in top[0]["scope"]
    (triton,) = [r for r in split.top_kernels(trace, parts, split.hlo_scopes(hlo), 6, steps=1)
                 if r["kernel"] == "grouped_rows_matmul__2"]
    assert triton["part"] == "moe" and triton["scope"] == "jit(step)/moe/pallas_call"


def test_decode_forms_alternatives_compute_the_models_ops():
    """benchmarks/decode_forms.py: each alternative form gives the model's result: the index head sum as a
    reduction and one key list for the decode attention in fp32, on a ragged top-k (−1 picks) and a ring with
    empty slots and keys past the window; an mHC site as products and with the matvec as a reduction, on bf16
    streams."""
    from dsv41_jax import config as Cfg

    forms = load_script("benchmarks/decode_forms.py")
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731

    iq, w, keys = f32(2, 1, 4, 8), f32(2, 1, 4), f32(2, 40, 8)
    model, alt = (jax.jit(f) for f in forms.index_forms().values())
    np.testing.assert_allclose(np.asarray(alt(iq, w, keys)), np.asarray(model(iq, w, keys)), rtol=1e-5, atol=1e-5)

    cfg = Cfg.v41_flash()
    m, d = cfg.mhc.hc_mult, 64
    carry = forms.mhc_carry(cfg, rng, 3, d)
    weights = (f32((2 + m) * m, m * d) * 0.1, f32((2 + m) * m), jnp.ones((3,), jnp.float32), f32(d))
    (xm, pm, *_), xm_out = jax.jit(forms.mhc_site(cfg, "model"))(carry, *weights)
    np.testing.assert_array_equal(np.asarray(xm_out), np.asarray(xm))
    for name in forms.MHC_FORMS[1:]:
        (xa, pa, *_), _ = jax.jit(forms.mhc_site(cfg, name))(carry, *weights)
        np.testing.assert_allclose(np.asarray(xa, np.float32), np.asarray(xm, np.float32), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        np.testing.assert_allclose(np.asarray(pa), np.asarray(pm), rtol=1e-6, atol=1e-7, err_msg=name)

    window, t, k, b = 8, 30, 6, 2
    start = jnp.array([20, 25], jnp.int32)
    ring_pos = jnp.array([[-1, -1, 13, 14, 15, 16, 17, 19], [18, 19, 20, 21, 22, 23, 24, 12]], jnp.int32)
    topk = jnp.asarray(np.sort(rng.choice(t, (b, 1, k)), -1), jnp.int32).at[1, 0, -2:].set(-1)
    a = (f32(b, 1, 4, 16), f32(b, 1, 16), f32(4), f32(b, window, 16), ring_pos, f32(b, t, 16), topk, start)
    model, alt = (jax.jit(f) for f in forms.attention_forms(window).values())
    np.testing.assert_allclose(np.asarray(alt(*a)), np.asarray(model(*a)), rtol=1e-5, atol=1e-5)
