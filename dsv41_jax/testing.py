"""Locations of the test data shipped with the repository (golden reference outputs, release configs), and
helpers of the tests. pytest is imported only by the test marker that needs it (``CPU_EXACT``): the library
imports this module for ``GOLDEN`` and must run where pytest is not installed."""

from __future__ import annotations

import os
from pathlib import Path

_DATA = Path(__file__).resolve().parents[1] / "tests" / "data"

# the official reference implementation's outputs on a tiny release-format checkpoint
GOLDEN = Path(os.environ.get("DSV41_GOLDEN", _DATA / "golden"))
# the released config.json and inference/config.json, byte for byte
RELEASE = _DATA / "release"

def __getattr__(name: str):
    if name == "typechecker":  # the tests' runtime checker of jaxtyping annotations (tests/conftest.py): beartype,
        # with PEP 484's numeric tower (an int where a float is annotated is a float)
        from beartype import BeartypeConf, beartype

        return beartype(conf=BeartypeConf(is_pep484_tower=True))
    if name == "CPU_EXACT":  # tests whose bounds are calibrated on XLA:CPU (bit-level or ~1e-6 agreement)
        import jax
        import pytest

        return pytest.mark.skipif(jax.default_backend() != "cpu", reason=(
            "bit-level and ~1e-6 comparisons are calibrated on XLA:CPU; XLA:GPU accumulates in another order and "
            "flips more QDQ-boundary values, so there the golden robust recipe of tests/test_gpu.py applies"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fake_cpu_env(n_devices: int = 8, extra_flags: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a child Python with ``n_devices`` fake CPU devices: the device count
    (and ``extra_flags``) added to the XLA flags of the environment, any other device count replaced."""
    import os

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=" ".join([*flags, *extra_flags, f"--xla_force_host_platform_device_count={n_devices}"]))


def run_on_fake_cpus(script, n_devices: int = 8, timeout: int = 900, *, compile_only: bool = False,
                     fast_compile: bool = False) -> list[dict]:
    """Run ``script`` in a child Python with ``n_devices`` fake CPU devices; its JSON lines, parsed.

    A child is needed because the test process has already initialised JAX with one device. ``compile_only``:
    the child only compiles and reads the programs (no numerics), so its LLVM runs at -O0 (the collectives
    child: 89 -> 69 s on 2 cores, the same report); ``fast_compile``: -O0 too for a child that runs many small
    programs a few times each, where LLVM's time outweighs the slower code.
    """
    import json
    import subprocess
    import sys

    extra = ("--xla_backend_optimization_level=0",) if compile_only or fast_compile else ()
    out = subprocess.run([sys.executable, str(script)], env=fake_cpu_env(n_devices, extra), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows, out.stdout[-2000:]
    return rows


def bigram_drafter(drafter, outputs: list[list[int]], skip: set[tuple[int, int]]):
    """The drafter's state with its Markov head holding the bigrams of ``outputs`` (except ``skip``) and the base
    head silenced (``mtp.{last}.norm`` = 0): it drafts what the reference decoded wherever that is a bigram."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    graphdef, state = nnx.split(drafter)
    d = nnx.merge(graphdef, jax.tree.map(jnp.array, state))
    last = d.mtp[-1]
    v, r = last.markov_head.embed.weight.shape
    emb = np.random.default_rng(2).normal(size=(v, r)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros((v, r), np.float32)
    for row in outputs:
        for a, b in zip(row[:-1], row[1:], strict=True):
            if (a, b) not in skip:
                head[b] += 20 * emb[a]
    last.norm.weight[...] = jnp.zeros_like(last.norm.weight[...])
    last.markov_head.embed.weight[...] = jnp.asarray(emb)
    last.markov_head.head.weight[...] = jnp.asarray(head)
    return nnx.state(d)


def mixed_products(jaxpr) -> list[str]:
    """The products (``dot_general``, ``ragged_dot_general``) of ``jaxpr`` and every jaxpr inside it (scans,
    remat, custom rules' traced backward) whose two operands have different dtypes: on GPU such a product is
    promoted to the wider dtype (an fp32 × bf16 gradient product runs as an fp32 GEMM). One line per product:
    its primitive, operand dtypes and shapes."""
    import jax

    found = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
                a, b = (v.aval for v in eqn.invars[:2])
                if a.dtype != b.dtype:
                    found.append(f"{eqn.primitive.name} {a.dtype}{list(a.shape)} x {b.dtype}{list(b.shape)}")
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jaxpr)
    return found
