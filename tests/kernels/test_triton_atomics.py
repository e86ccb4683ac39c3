"""``pallas_kernels.triton_atomics``: relaxed fp32 atomic adds (the interpreter's sums, and the Triton IR's ordering
lowered for CUDA on this machine)."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import triton_atomics


def _adder(add, rows: int, programs: int, *, interpret: bool, debug: bool = False):
    """Program ``i`` adds its [rows, 8] block into rows ``dest[i]`` of the output (rows shared between programs)."""
    def kernel(dest_ref, val_ref, out_in, out_ref):
        del out_in
        i = pl.program_id(0)
        dest = dest_ref[i, :]
        lanes = jnp.arange(8)
        if interpret:  # the interpreter's gathered add keeps one of a repeated row: one row an add
            for r in range(rows):
                add(out_ref, (pl.ds(dest[r], 1), pl.ds(0, 8)), val_ref[i, pl.ds(r, 1), :])
        else:
            add(out_ref, (dest[:, None], lanes[None, :]), val_ref[i])

    def call(dest, val, out):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out.shape, jnp.float32), grid=(programs,),
                              input_output_aliases={2: 0}, interpret=interpret, debug=debug,
                              compiler_params=plt.CompilerParams(num_warps=1))(dest, val, out)
    return call


def test_relaxed_adds_sum_every_programs_rows():
    rng = np.random.default_rng(0)
    programs, rows, entries = 6, 16, 10
    dest = rng.integers(0, entries, (programs, rows)).astype(np.int32)  # rows repeat within and across programs
    val = rng.standard_normal((programs, rows, 8)).astype(np.float32)
    start = rng.standard_normal((entries, 8)).astype(np.float32)
    want = start.copy()
    np.add.at(want, dest.reshape(-1), val.reshape(-1, 8))
    got = jax.jit(_adder(triton_atomics.add, rows, programs, interpret=True))(
        jnp.asarray(dest), jnp.asarray(val), jnp.asarray(start))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def _triton_ir(add) -> str:
    """The Triton module of a kernel that adds with ``add``, lowered for CUDA (no GPU needed: the module is
    printed at lowering time)."""
    call = _adder(add, 16, 2, interpret=False, debug=True)
    args = (jnp.zeros((2, 16), jnp.int32), jnp.zeros((2, 16, 8), jnp.float32), jnp.zeros((16, 8), jnp.float32))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))
    return out.getvalue()


@pytest.mark.skipif(not triton_atomics.RELAXED, reason="this JAX lacks the internals the relaxed add reuses")
def test_the_add_lowers_to_a_relaxed_atomic_and_pallas_default_is_left_alone():
    ours = [line for line in _triton_ir(triton_atomics.add).splitlines() if "tt.atomic_rmw" in line]
    theirs = [line for line in _triton_ir(plt.atomic_add).splitlines() if "tt.atomic_rmw" in line]
    assert ours and all("tt.atomic_rmw fadd, relaxed, gpu" in line for line in ours), ours
    # the builder swap is undone after lowering: Pallas's own add keeps its ordering
    assert theirs and all("tt.atomic_rmw fadd, acq_rel, gpu" in line for line in theirs), theirs


@pytest.mark.gpu
@pytest.mark.parametrize("add", [triton_atomics.add, plt.atomic_add], ids=["relaxed", "acq_rel"])
def test_compiled_adds_sum_every_programs_rows_on_gpu(add):
    """On the device, rows repeated within a program's block and across 64 programs: every add lands (the
    gathered add as the sparse backward issues it, unmasked), relaxed or not."""
    rng = np.random.default_rng(1)
    programs, rows, entries = 64, 16, 12
    dest = rng.integers(0, entries, (programs, rows)).astype(np.int32)
    val = rng.standard_normal((programs, rows, 8)).astype(np.float32)
    want = np.zeros((entries, 8), np.float32)
    np.add.at(want, dest.reshape(-1), val.reshape(-1, 8))
    got = jax.jit(_adder(add, rows, programs, interpret=False))(jnp.asarray(dest), jnp.asarray(val),
                                                                jnp.zeros((entries, 8), jnp.float32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
