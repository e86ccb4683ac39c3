"""The KV stores as pytrees: construction checks the fields' annotations (tests/conftest.py's import hook),
rebuilding from JAX's placeholder leaves does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jaxtyping
import pytest

from dsv41_jax.model import DenseKV


def test_dense_kv_checks_its_fields_but_rebuilds_from_placeholders():
    main, index = jnp.ones((2, 6, 8)), jnp.ones((2, 6, 4))
    with pytest.raises(jaxtyping.TypeCheckError, match="DenseKV"):
        DenseKV(jnp.ones((6, 8)), index)  # main without its batch axis
    with pytest.raises(jaxtyping.TypeCheckError, match="DenseKV"):
        DenseKV(main, jnp.ones((2, 5, 4)))  # index over 5 entries, main over 6

    store = DenseKV(main, index, qdq_main=False)
    shapes = jax.eval_shape(lambda s: DenseKV(s.main * 2, s.index, qdq_main=s.qdq_main), store)
    assert isinstance(shapes.main, jax.ShapeDtypeStruct) and shapes.main.shape == (2, 6, 8)
    assert shapes.qdq_main is False  # static: kept through flatten / unflatten
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(store)[0]]
    assert paths == [".main", ".index"]
    doubled = jax.jit(lambda s: jax.tree.map(lambda a: a * 2, s))(store)
    assert type(doubled) is DenseKV and float(doubled.main[0, 0, 0]) == 2.0 and doubled.qdq_main is False
