# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of dsv41-jax on the tiny config
#
# The tiny config keeps every structural feature of DeepSeek-V4.1-Flash (every layer role, Engram, DSpark,
# mHC with 4 streams, the shared expert) at toy width, so everything below runs on a CPU in about a minute.
# The released config appears only through abstract shapes: nothing of its size is allocated. The notebook
# imports the library and holds no model code; its `assert`s are checks of the library, so running it is a test
# (`tests/test_notebooks.py`). It is paired with `tour.py` by jupytext: after editing either file,
# `jupytext --sync notebooks/tour.py` (or `tour.ipynb`) brings the other up to date.

# %%
import math
from collections import Counter

import jax
import numpy as np
from flax import nnx

from dsv41_jax import config, engine, topology
from dsv41_jax.cache import init_cache, ledger
from dsv41_jax.checkpoint.tree import flat_variables
from dsv41_jax.engine.sampling import Generator, SamplingConfig
from dsv41_jax.engram_device import device_engram
from dsv41_jax.engram_hash import EngramHasher, check_token_map
from dsv41_jax.model import Transformer
from dsv41_jax.model.transformer import abstract_model
from dsv41_jax.scoring import row_rel_l2

tiny = config.tiny().replace(dtype="float32")  # fp32 activations: the exact semantics, and the test precision
release = config.v41_flash()

# %% [markdown]
# ## Topology is data
#
# `topology.describe` turns a config into one row per layer: encoder or decoder part, compression ratio m, role
# (SWA only; Full layers compute and publish compressed KV, index keys and top-k; Reindex layers select their own
# top-k from another layer's index keys; Reuse layers read both), where each layer's KV and top-k come from, the
# candidate pool's source and users, Engram, and the RoPE kind. The release and the tiny config differ only in
# numbers: every role occurs in both.

# %%
print(topology.describe(tiny))
tiny_roles = Counter(spec.role for spec in topology.topology(tiny))
release_roles = Counter(spec.role for spec in topology.topology(release))
print(f"\nroles, tiny ({tiny.n_layers} layers):     {dict(tiny_roles)}")
print(f"roles, release ({release.n_layers} layers): {dict(release_roles)}")
assert set(tiny_roles) == set(release_roles)

# %% [markdown]
# ## The cache ledger
#
# Bytes the inference cache holds, computed with `jax.eval_shape` from the packed cache arrays themselves (spec
# attention §7.5): global KV (FP4 main KV with E4M3 scales and MXFP4 index keys, shared across layers) per token,
# and the FP8 sliding-window rings per sequence. The release reads 890 bytes per token of global KV.

# %%
for name, cfg in (("tiny", tiny), ("release", release)):
    led = ledger(cfg)
    print(f"{name:8s} global KV {led['global_kv_bytes_per_token']:7,.1f} B/token   "
          f"SWA rings {led['swa_bytes_per_sequence']:11,.0f} B/sequence")
release_ledger = ledger(release)
assert release_ledger["global_kv_bytes_per_token"] == 890
assert release_ledger["swa_bytes_per_sequence"] == 2_703_360

# %% [markdown]
# ## Parameters of the release, from abstract shapes
#
# `abstract_model` builds the release model with `ShapeDtypeStruct` leaves, named as in the checkpoint, in about a
# second and with no memory.

# %%
groups = Counter()
for name, var in flat_variables(abstract_model(release)).items():
    group = ("Engram tables" if name.endswith("engram.embed.weight") else
             "routed experts" if ".ffn.experts." in name else "everything else")
    groups[group] += math.prod(var.shape)
backbone = groups["routed experts"] + groups["everything else"]
for group, n in (*groups.items(), ("backbone (all but Engram tables)", backbone)):
    print(f"{group:34s} {n / 1e9:8.2f} B")
assert round(backbone / 1e9, 2) == 551.88 and round(groups["Engram tables"] / 1e9, 2) == 196.61

# %% [markdown]
# ## The tiny model, with Engram rows
#
# Engram row ids are host-side integer hashes of the n-grams ending at each position (spec model §6), taken over
# *compressed* token ids: a checkpoint's tokenizer maps raw ids to them (`engram_hash.build_token_map`). Random
# weights need no tokenizer, so any map onto exactly `compressed_vocab_size` ids will do (here: the raw id modulo
# that size). The training forward (`Transformer.__call__`) gives fp32 logits at every position.

# %%
model = Transformer(tiny, rngs=nnx.Rngs(0))
token_map = np.arange(tiny.vocab_size) % tiny.engram.compressed_vocab_size
check_token_map(token_map, tiny.engram)
hasher = EngramHasher(tiny.engram, token_map)

B, S, P = 4, 16, 8  # sequences, tokens per sequence, prompt tokens (the rest is decoded below)
rng = np.random.default_rng(0)
tokens = np.concatenate([np.full((B, 1), tiny.bos_token_id), rng.integers(3, tiny.vocab_size, (B, S - 1))], 1)
rows, _ = hasher.row_ids(tokens)  # int64 [B, S, Engram layers, columns]

graphdef, state = nnx.split(model)
forward = jax.jit(lambda state, tokens, rows: nnx.merge(graphdef, state)(tokens, rows))
logits = np.asarray(forward(state, tokens, rows))  # [B, S, V]
print(f"tokens {tokens.shape}, Engram rows {rows.shape}, logits {logits.shape}")

# %% [markdown]
# ## The engine reproduces the training forward
#
# The engine runs over the packed cache (FP4 main KV, MXFP4 index keys, FP8 window rings); the training forward
# fake-quantises the same values. `engine.forward_chunk` is its one primitive: it feeds `tokens[b, :n_new[b]]`
# after what the cache holds (prefill is a long chunk, decode a chunk of one). An exact prefill of all 16 tokens
# computes what the forward computes, so the logits agree to fp32 rounding, except where one of the many quantised
# values lands within that rounding of an FP8 / FP4 boundary and takes the neighbouring code in one of the two
# programs (seen on some CPUs: 1.9e-4 on a few rows); every greedy choice is the same.

# %%
chunk = jax.jit(lambda state, cache, tokens, rows, n_new: engine.forward_chunk(
    nnx.merge(graphdef, state), cache, tokens, rows, n_new, options=engine.ChunkOptions(all_logits=True)))
got, _ = chunk(state, init_cache(tiny, B, 64), tokens, rows, np.full(B, S, np.int32))
err = row_rel_l2(np.asarray(got), logits)
print(f"exact prefill, every position: max abs diff {np.abs(np.asarray(got) - logits).max():.1e}; "
      f"relative L2 per row: median {np.median(err):.1e}, max {err.max():.1e}")
assert np.median(err) < 2e-6 and err.max() < 2e-3
assert (np.asarray(got).argmax(-1) == logits.argmax(-1)).all()

# %% [markdown]
# Now the serving pattern: an exact prefill of the first 8 tokens (the same compiled chunk, with `n_new` = 8),
# then the other 8 fed one at a time through `engine.decode_step` (teacher forcing). Decoding multiplies one row
# at a time, so sums run in another order than in the forward and values agree to about 1e-6. Now and then one
# of the many quantised values lands within that of an FP8 / FP4 rounding boundary and takes the neighbouring
# code, which moves the rows after it by up to about 1e-3 (tests/data/golden/README.md §7). So the bulk is held
# to rounding level, every row to that bound, and every greedy choice must be the same.

# %%
decode = jax.jit(lambda state, cache, tokens, rows: engine.decode_step(nnx.merge(graphdef, state), cache, tokens,
                                                                         rows))
prompt_logits, cache = chunk(state, init_cache(tiny, B, 64), tokens, rows, np.full(B, P, np.int32))
served = [np.asarray(prompt_logits)[:, P - 1]]  # logits at positions P-1, P, ..., S-1
for p in range(P, S):
    last, cache = decode(state, cache, tokens[:, p], rows[:, p:p + 1])
    served.append(np.asarray(last))
served = np.stack(served, axis=1)  # [B, S-P+1, V]
want = logits[:, P - 1:]
err = row_rel_l2(served, want)
print(f"prefill {P} + decode {S - P}: max abs diff {np.abs(served - want).max():.1e}; "
      f"relative L2 per row: median {np.median(err):.1e}, max {err.max():.1e}")
assert np.median(err) < 2e-6 and err.max() < 2e-3
assert (served.argmax(-1) == want.argmax(-1)).all()

# %% [markdown]
# ## Greedy generation
#
# `Generator` compiles the chunked prefill and a decode loop that runs `block` steps per call, hashing Engram rows
# on the device. Greedy decoding from random weights is meaningless text but a precise check: each generated token
# must be the argmax of the training forward over the prompt and the tokens before it.

# %%
sampling = SamplingConfig(temperature=0.0, max_new_tokens=S - P, stop_tokens=(), prefill_chunk=P, block=S - P)
generator = Generator(model, device_engram(hasher), batch=B, max_seq_len=64, sampling=sampling)
new = np.array(generator.generate(tokens[:, :P].tolist()))  # [B, S-P]
print(new)
full = np.concatenate([tokens[:, :P], new], axis=1)
full_rows, _ = hasher.row_ids(full)
assert (np.asarray(forward(state, full, full_rows))[:, P - 1:-1].argmax(-1) == new).all()

# %% [markdown]
# ## Pictures: a run's curves and the benchmark charts
#
# `dsv41 plot RUN_DIR` (`plot_run`) draws a run's loss, learning-rate, throughput and expert-imbalance curves
# from its `metrics.jsonl`; after the README's first command they are those of `runs/pretrain_tiny`.
# `benchmarks/charts.py` draws BENCHMARKS.md's tables into `docs/benchmarks/`; the first is shown below.

# %%
from pathlib import Path  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402

from dsv41_jax.train.plot import plot_run  # noqa: E402

repo = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
run = repo / "runs" / "pretrain_tiny"
pictures = sorted((repo / "docs" / "benchmarks").glob("*.png"))
if (run / "metrics.jsonl").is_file():
    pictures = list(plot_run(run, Path("/tmp") / "tour_plots").values()) + pictures[:1]
else:
    print(f"no run at {run}: train one with the README's first command to see its curves here")
    pictures = pictures[:1]
for path in pictures:
    plt.figure(figsize=(12, 3))
    plt.imshow(plt.imread(path))
    plt.axis("off")
    plt.title(path.name, fontsize=8)
    plt.show()
assert pictures, "docs/benchmarks/ holds the charts (python benchmarks/charts.py)"
