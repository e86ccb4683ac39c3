"""fp32 atomic adds with relaxed ordering for Pallas Triton kernels: sums that many programs add into HBM.

``plt.atomic_add`` lowers to ``tt.atomic_rmw`` with acquire-release ordering at GPU scope, so every add waits
on a memory barrier before the next memory operation of its thread may issue. A sum accumulated by atomics
(the sparse attention backward's dKV: each entry collects the row gradients of the ~1,000 queries that picked
it) needs no ordering between its adds, only their completion when the kernel ends; relaxed ordering is what
XLA's own scatter-add emits. Measured on one H100 (``BENCHMARKS.md``): ``triton_mqa.sparse_mqa_bwd`` at
``configs/small.yaml``'s 16 heads × 256 and 8K queries took 9.78 ms with acquire-release adds (Nsight Compute:
43 % of the warps' cycles stalled on the memory barrier) and 3.45 ms with relaxed ones, with the same sums.

JAX offers no ordering argument, so :func:`add` binds a primitive of its own that reuses ``atomic_rmw``'s
abstract evaluation, its discharge rule (the Pallas interpreter) and its Triton lowering, the last with the
ordering relaxed. These are JAX internals: where this JAX lacks one of them, :data:`RELAXED` is False and
:func:`add` is ``plt.atomic_add`` (the same sums, slower).
"""

from __future__ import annotations

import contextlib
import functools

from jax import tree_util
from jax.experimental.pallas import triton as plt


def _primitive():
    """The relaxed add's primitive, or None where this JAX does not have the pieces it reuses."""
    try:
        from jax._src import core
        from jax._src.lib.triton import dialect as tt
        from jax._src.pallas.triton import lowering, primitives
        from jax._src.state import discharge
        from jax._src.state import primitives as state_primitives

        base = primitives.atomic_rmw_p
        rule = lowering.triton_lowering_rules[base]
        relaxed = tt.MemSemantic.RELAXED
        atomic = lowering._atomic_rmw  # the lowering rule's builder of tt.atomic_rmw; ordering is its argument
        if "semantic" not in atomic.__code__.co_varnames:
            return None
        add_type = primitives.AtomicOpType.ADD
        refs = state_primitives.get_ref_and_transforms
        discharge_rule = discharge._discharge_rules[base]
    except (ImportError, AttributeError, KeyError):
        return None

    prim = core.Primitive("atomic_add_relaxed")
    prim.def_effectful_abstract_eval(base.abstract_eval)
    discharge.register_discharge_rule(prim)(discharge_rule)

    @contextlib.contextmanager
    def relaxed_builder():
        lowering._atomic_rmw = functools.partial(atomic, semantic=relaxed)
        try:
            yield
        finally:
            lowering._atomic_rmw = atomic

    def lower(ctx, *args, **params):
        # the builder is swapped only while this rule runs and always restored to the original (an atomic that
        # another thread lowers in that instant would be relaxed too: JAX lowers a trace on its caller's thread)
        with relaxed_builder():
            return rule(ctx, *args, **params)

    lowering.register_lowering(prim)(lower)

    def bind(ref, idx, val, mask):
        ref, transforms = refs(ref, idx, "atomic_add_relaxed")
        flat, tree = tree_util.tree_flatten((ref, transforms, val, mask))
        return prim.bind(*flat, args_tree=tree, atomic_type=add_type)

    return bind


_BIND = _primitive()
RELAXED = _BIND is not None  # whether this JAX lets :func:`add` lower with relaxed ordering
# read when a kernel is traced: False gives Pallas's own acquire-release add (the bench's baseline)
USE_RELAXED = RELAXED


def add(ref, idx, val, *, mask=None) -> None:
    """``ref[idx] += val`` atomically, unordered with respect to the program's other memory operations (what a
    sum into HBM needs); ``mask`` as ``plt.atomic_add``'s (the value's full shape). Nothing may read ``ref``'s
    sums in the same kernel."""
    if _BIND is None or not USE_RELAXED:
        plt.atomic_add(ref, idx, val, mask=mask)
    else:
        _BIND(ref, idx, val, mask)
