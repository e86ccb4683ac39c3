"""The model code exists once: one attention layer, one stack loop, one sparse attention core.

Training, the engine and post-training run :class:`~dsv41_jax.model.attention.Attention` over a KV store and
:meth:`~dsv41_jax.model.transformer.Transformer.run_layers`; a second copy of either (or of the Full /
Reindex / Reuse dispatch) would make every later change land three times. These checks read the source
(``ast``), so they fail the moment such a copy appears, wherever it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[2] / "dsv41_jax"
MODEL = LIBRARY / "model"
# a separate network: the vision tower's dense bidirectional ViT attention shares nothing with CSA2, so it may
# define its own modules (it still may not touch the layer's dispatch or the sparse core)
OTHER_NETWORKS = {LIBRARY / "vision" / "encoder.py"}
# the engine's KV store (PackedKV) scores its own packed keys when the layer asks it to (KVStore.index_scores)
STORES = {LIBRARY / "cache.py": {"index_scores"}}
# the layer's role predicates (topology.LayerSpec) and the selection functions only the layer may use
DISPATCH = {"owns_compressor", "has_indexer", "uses_candidates", "candidate_source"}
SELECTION = {"select_topk", "candidate_block_ids", "candidate_blocks", "index_scores", "gathered_index_scores",
             "sparse_attention", "entry_mass"}


def _modules():
    for path in sorted(LIBRARY.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(LIBRARY.parent)}:{node.lineno}"


def _enclosing(tree: ast.AST) -> dict[ast.AST, str]:
    """Every node -> the qualified name of the function it is in ("" at module level)."""
    owner: dict[ast.AST, str] = {}

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            here = name
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                here = f"{name}.{child.name}" if name else child.name
            owner[child] = here
            visit(child, here)

    visit(tree, "")
    return owner


def _called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return None


def test_one_stack_loop():
    """Only ``Transformer.run_layers`` iterates over the blocks of a model (directly, or over the runs of layer
    groups that ``segments`` plans)."""
    loops = []
    for path, tree in _modules():
        owner = _enclosing(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.comprehension)) and ("layers" in {
                    n.attr for n in ast.walk(node.iter) if isinstance(n, ast.Attribute)} or "segments" in {
                    _called(n) for n in ast.walk(node.iter)}):
                loops.append((_where(path, node.iter), owner.get(node, "")))
    assert [f for _, f in loops] == ["Transformer.run_layers"], loops


def test_one_attention_layer_and_dispatch():
    """The role dispatch (Full / Reindex / Reuse, candidate pool, top-k) and the sparse core are used only by
    the layer and the stack; no other module defines a layer or calls an attention module itself."""
    seen = []
    for path, tree in _modules():
        in_model = path.parent == MODEL or path.name == "topology.py"
        for node in ast.walk(tree):
            if not in_model and isinstance(node, ast.Attribute) and node.attr in DISPATCH:
                seen.append(f"{_where(path, node)} reads LayerSpec.{node.attr}")
            if not in_model and _called(node) in SELECTION - STORES.get(path, set()):
                seen.append(f"{_where(path, node)} calls {_called(node)}")
            if not in_model and path not in OTHER_NETWORKS and isinstance(node, ast.ClassDef) and any(
                    "Module" in ast.unparse(b) for b in node.bases):
                seen.append(f"{_where(path, node)} defines a module {node.name}")
    assert not seen, seen


@pytest.mark.parametrize("name, callers", [("sparse_attention", ["Attention._attend"]),
                                           ("select_topk", ["Attention._select_scoped"]),
                                           ("packed_attention", ["Attention._attend"]),
                                           # the layer asks its store; each store scores its own key format
                                           ("index_scores", ["PackedKV.index_scores", "Attention._select_scoped",
                                                             "DenseKV.index_scores"])])
def test_the_core_has_one_call_site(name, callers):
    """The sparse attention core and the selection are called from exactly one place in the library (the
    index score: one place in the layer, and once in each store), so a kernel behind ``kernel_backend``
    replaces them everywhere at once."""
    sites = []
    for path, tree in _modules():
        owner = _enclosing(tree)
        sites += [(_where(path, n), owner[n]) for n in ast.walk(tree) if _called(n) == name]
    assert [c for _, c in sites] == callers, sites


def test_engine_and_posttrain_build_on_the_model():
    """The engine's chunk forward and the served post-training forward run the model's stack."""
    for rel in ("engine/step.py", "posttrain/replay.py"):
        tree = ast.parse((LIBRARY / rel).read_text())
        calls = {_called(n) for n in ast.walk(tree)}
        assert "run_layers" in calls, rel
        assert not {"attn", "publish"} & calls, rel
