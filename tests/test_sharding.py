"""Logical axes on every parameter, their mapping through LOGICAL_RULES, and placing the tiny model's state
on an 8-device (fake CPU) mesh by those specs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsv41_jax import config as C
from dsv41_jax.model.moe import RouterBias
from dsv41_jax.model.transformer import Transformer
from dsv41_jax.sharding import LOGICAL_RULES, PARAM_AXES, logical_to_mesh, state_partition_specs
from dsv41_jax.testing import fake_cpu_env

MESH_AXES = ("data", "fsdp", "expert", "tensor")
MESH_SHAPE = (2, 2, 2, 1)


def _name(path) -> str:
    return ".".join(str(p) for p in path)


@pytest.fixture(scope="module")
def tiny_model_state() -> nnx.State:
    return nnx.state(Transformer(C.tiny(), rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def tiny_state(tiny_model_state) -> dict[str, nnx.Variable]:
    return {_name(p): v for p, v in nnx.to_flat_state(tiny_model_state)}


@pytest.fixture(scope="module")
def tiny_specs(tiny_model_state) -> dict[str, P]:
    return {_name(p): s for p, s in nnx.to_flat_state(state_partition_specs(tiny_model_state))}


def _axes(var: nnx.Variable):
    return var.get_metadata().get("out_sharding")


def test_state_holds_only_parameters(tiny_state):
    # no RNG state or caches leak into the parameter state that gets sharded
    assert tiny_state
    assert all(type(v) in (nnx.Param, RouterBias) for v in tiny_state.values())
    assert sum(isinstance(v, RouterBias) for v in tiny_state.values()) == 2 * 12


def test_every_variable_has_logical_axes(tiny_state):
    for name, var in tiny_state.items():
        axes = _axes(var)
        assert isinstance(axes, tuple), f"{name}: no logical axes ({axes!r})"
        assert len(axes) == var.get_value().ndim, f"{name}: axes {axes} for shape {var.get_value().shape}"
        assert all(a is None or isinstance(a, str) for a in axes), f"{name}: {axes}"


def test_logical_names_all_have_rules(tiny_state):
    # a logical name without a rule would silently replicate; every one in use must be in the table
    used = {a for v in tiny_state.values() for a in _axes(v) if a is not None}
    assert used <= set(LOGICAL_RULES), sorted(used - set(LOGICAL_RULES))
    declared = {a for axes in PARAM_AXES.values() for a in axes if a is not None}
    assert declared <= set(LOGICAL_RULES)


def _by_rules(axes) -> P:
    """Each dimension gets its rule's mesh axes that earlier dimensions left (a mesh axis shards one dim)."""
    out, used = [], set()
    for a in axes:
        rule = None if a is None else LOGICAL_RULES.get(a)
        run = tuple(x for x in ((rule,) if isinstance(rule, str) else rule or ()) if x not in used)
        used.update(run)
        out.append(None if not run else run[0] if len(run) == 1 else run)
    return P(*out)


def test_specs_follow_rules(tiny_state, tiny_specs):
    assert set(tiny_specs) == set(tiny_state)
    for name, var in tiny_state.items():
        expected = _by_rules(_axes(var))
        assert tiny_specs[name] == expected, name
        assert logical_to_mesh(_axes(var)) == expected


def test_release_engram_tables_shard_by_rows_or_columns():
    """Row counts are sums of primes: layer 1's divides fsdp = 8 but not 64, layer 14's nothing. The columns
    take the mesh axes the rows leave, so both tables split 64 ways instead of one replicating."""
    mesh = jax.sharding.AbstractMesh((1, 8, 8, 1), MESH_AXES)
    rows = C.v41_flash().engram.num_embeddings
    axes = ("engram_rows", "engram_cols")
    assert logical_to_mesh(axes, shape=(rows[0], 256), mesh=mesh) == P("fsdp", "expert")
    assert logical_to_mesh(axes, shape=(rows[1], 256), mesh=mesh) == P(None, ("fsdp", "expert"))


@pytest.mark.parametrize("name, spec", [
    ("embed.weight", P("tensor", "fsdp")),
    ("head.weight", P("tensor", "fsdp")),
    ("norm.weight", P(None)),
    ("layers.0.attn.wq_a.weight", P(None, "fsdp")),
    ("layers.0.attn.wq_b.weight", P("tensor", None)),
    ("layers.0.attn.wo_a.weight", P("tensor", None)),
    ("layers.0.attn.wo_b.weight", P("fsdp", "tensor")),
    ("layers.0.attn.attn_sink", P("tensor")),
    ("layers.0.ffn.gate.weight", P("expert", "fsdp")),
    ("layers.0.ffn.gate.bias", P("expert")),
    ("layers.0.ffn.experts.w1.weight", P("expert", "tensor", "fsdp")),
    ("layers.0.ffn.experts.w2.weight", P("expert", "fsdp", "tensor")),
    ("layers.0.ffn.shared_experts.w2.weight", P("fsdp", "tensor")),
    ("layers.0.hc_attn_fn", P(None, "fsdp")),
    ("layers.1.engram.embed.weight", P(("fsdp", "expert"), None)),
    ("layers.2.attn.indexer.wk.weight", P(None, None)),
])
def test_spec_spot_checks(tiny_specs, name, spec):
    assert tiny_specs[name] == spec


def test_specs_are_valid_partition_specs(tiny_state, tiny_specs):
    for name, spec in tiny_specs.items():
        assert len(spec) == tiny_state[name].get_value().ndim, name
        flat = [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]
        assert set(flat) <= set(MESH_AXES), (name, spec)
        assert len(flat) == len(set(flat)), f"{name}: mesh axis used twice in {spec}"


def _indivisible(shapes: dict[str, tuple[int, ...]], specs: dict[str, P], sizes: dict[str, int]) -> set[str]:
    def ways(entry):
        return math.prod(sizes[a] for a in (entry if isinstance(entry, tuple) else (entry,))) if entry else 1
    return {n for n, spec in specs.items() if any(d % ways(e) for d, e in zip(shapes[n], spec, strict=True))}


def test_which_dims_need_a_divisibility_fallback(tiny_state, tiny_specs):
    # On data=2, fsdp=2, expert=2, tensor=1 only the Engram tables fail: their rows (sums of primes, 434 and
    # 606 in tiny) go on fsdp×expert = 4 ways. The release's layer-14 table (384,016,682 rows) fails too.
    shapes = {n: tuple(v.get_value().shape) for n, v in tiny_state.items()}
    sizes = dict(zip(MESH_AXES, MESH_SHAPE, strict=True))
    assert _indivisible(shapes, tiny_specs, sizes) == {"layers.1.engram.embed.weight", "layers.4.engram.embed.weight"}
    release = C.v41_flash().engram.num_embeddings
    assert [r % (sizes["fsdp"] * sizes["expert"]) for r in release] == [0, 2]


# ----------------------------------------------------------------------------------------------------
# 8 fake CPU devices: a child process, because this one has already initialised JAX with 1 device

_CHILD = textwrap.dedent("""
    import json, math, sys
    import jax, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from dsv41_jax import config as C
    from dsv41_jax.model.transformer import Transformer
    from dsv41_jax.sharding import state_partition_specs

    AXES = ("data", "fsdp", "expert", "tensor")

    def run(axis_type):
        mesh = jax.make_mesh((2, 2, 2, 1), AXES, axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 4)
        sizes = dict(mesh.shape)
        model = Transformer(C.tiny(), rngs=nnx.Rngs(0))
        state = nnx.state(model)
        specs = {p: s for p, s in nnx.to_flat_state(state_partition_specs(state))}
        fitted = {p: s for p, s in nnx.to_flat_state(state_partition_specs(state, mesh=mesh))}
        raw_failures, changed, bad = {}, [], []
        for path, var in nnx.to_flat_state(state):
            name = ".".join(map(str, path))
            x = np.asarray(var.get_value())
            spec = specs[path]
            try:
                jax.device_put(x, NamedSharding(mesh, spec)).block_until_ready()
            except Exception as err:  # noqa: BLE001 -- recorded and asserted on by the parent
                raw_failures[name] = f"{type(err).__name__}: {err}"[:300]
            fixed = fitted[path]
            if fixed != spec:
                changed.append(name)
            y = jax.device_put(x, NamedSharding(mesh, fixed))
            ways = [1 if e is None else math.prod(sizes[a] for a in (e if isinstance(e, tuple) else (e,)))
                    for e in fixed]
            want = tuple(d // w for d, w in zip(x.shape, ways))
            shards = {tuple(s.data.shape) for s in y.addressable_shards}
            if (y.sharding.spec != fixed or shards != {want} or len(y.addressable_shards) != 8
                    or not np.array_equal(np.asarray(y), x)):
                bad.append(f"{name}: spec {y.sharding.spec} shards {shards} want {want}")
        return {"n": len(specs), "raw_failures": raw_failures, "changed": sorted(changed), "bad": bad}

    assert jax.device_count() == 8, jax.devices()
    print(json.dumps({t: run(t) for t in sys.argv[1:]}))
""")


@pytest.fixture(scope="module")
def eight_devices() -> dict:
    env = fake_cpu_env(8)
    proc = subprocess.run([sys.executable, "-c", _CHILD, "Explicit", "Auto"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_tiny_state_shards_on_8_devices(eight_devices, tiny_state, axis_type):
    r = eight_devices[axis_type]
    assert r["n"] == len(tiny_state)
    # with the mesh given, state_partition_specs' divisibility fallback places every leaf with the
    # expected spec, shard shapes and values
    assert not r["bad"], r["bad"][:10]
    # and the fallback touched exactly the Engram tables (only their row dim)
    assert r["changed"] == ["layers.1.engram.embed.weight", "layers.4.engram.embed.weight"]


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_only_engram_tables_fail_without_fallback(eight_devices, axis_type):
    failures = eight_devices[axis_type]["raw_failures"]
    assert set(failures) == {"layers.1.engram.embed.weight", "layers.4.engram.embed.weight"}
    assert all("partitioned 4 times" in msg for msg in failures.values()), failures
