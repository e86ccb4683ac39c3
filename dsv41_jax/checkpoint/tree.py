"""Our parameter tree as a flat ``{dotted name: variable}`` map, named like the release checkpoint.

``layers.3.attn.wq_a.weight`` is the same string in the checkpoint and in our NNX state (routed experts
are stacked: ``layers.3.ffn.experts.w1.weight`` is [E, out, in]), so conversion is a table, not a puzzle.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

# checkpoint subtrees of modules that live outside the text backbone
NON_BACKBONE_PREFIXES = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")


def flat_variables(model: nnx.Module) -> dict[str, nnx.Variable]:
    """Every variable of ``model`` (parameters and router biases) by dotted checkpoint name."""
    return {".".join(str(p) for p in path): var for path, var in nnx.iter_graph(model)
            if isinstance(var, nnx.Variable)}


def assign(model: nnx.Module, arrays: Mapping[str, np.ndarray], *,
           ignore_prefixes: tuple[str, ...] = NON_BACKBONE_PREFIXES) -> None:
    """Set every variable of ``model`` from ``arrays``, cast to the variable's dtype.

    Every variable must be provided with its exact shape; names the model does not have are an error unless
    they start with one of ``ignore_prefixes`` (subtrees owned by other modules).
    """
    variables = flat_variables(model)
    missing = sorted(set(variables) - set(arrays))
    extra = sorted(n for n in set(arrays) - set(variables) if not n.startswith(ignore_prefixes))
    wrong = sorted(f"{n}: checkpoint {tuple(np.shape(arrays[n]))} vs model {tuple(v.shape)}"
                   for n, v in variables.items() if n in arrays and tuple(np.shape(arrays[n])) != tuple(v.shape))
    if missing or extra or wrong:
        lines = ([f"missing ({len(missing)}): {', '.join(missing[:20])}"] if missing else []) + \
                ([f"unexpected ({len(extra)}): {', '.join(extra[:20])}"] if extra else []) + \
                ([f"shape mismatch ({len(wrong)}): {'; '.join(wrong[:20])}"] if wrong else [])
        raise ValueError("parameters do not match the model:\n  " + "\n  ".join(lines))
    for name, var in variables.items():
        var[...] = jnp.asarray(arrays[name], dtype=var.dtype)
