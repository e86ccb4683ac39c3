"""Model configuration schema: the frozen dataclasses and their validation.

The field names follow the reference ``inference/config.json`` (``ModelArgs``) where one exists, grouped
into sub-configs so that each module receives only its own part (spec model §1.2, §1.3).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

KERNEL_BACKENDS = ("xla", "pallas")  # = pallas_kernels.*.api.BACKENDS
GROUPED_MATMULS = ("auto", "xla", "tokamax", "pallas")  # = dsv41_jax.model.moe.grouped_matmul's implementations
ROUTED_PATHS = ("auto", "gather", "dense", "grouped")  # dsv41_jax.model.moe.routed_path


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or inconsistent; the message names key and file."""


def fail(msg: str, source: str | None = None) -> typing.NoReturn:
    """Raise a :class:`ConfigError`, prefixed by the file (``source``) when there is one."""
    raise ConfigError(f"{source}: {msg}" if source else msg)


@dataclass(frozen=True)
class CacheQuant:
    """Which cache formats the training forward fake-quantises (spec attention §7, §7.6).

    All on is the released model: the numerics it was post-trained with and the engine serves (the packed
    cache always stores these formats). Switching one off gives the exact full-precision path for that
    cache, e.g. for pre-training before QAT or as the reference of a served-gap evaluation. Not part of the
    HF ``config.json`` (a training choice, not an architecture value).
    """

    main_kv: bool = True  # NVFP4 (E2M1 + E4M3 per 16) main KV after RoPE (§7.2)
    index: bool = True  # MXFP4 indexer queries and keys (§7.3)
    swa: bool = True  # FP8 E4M3 + UE8M0 per 32 SWA KV (§7.1)


@dataclass(frozen=True)
class AttentionConfig:
    n_heads: int = 64
    head_dim: int = 512  # = the shared K/V latent width (MQA, one KV head)
    rope_head_dim: int = 64  # trailing lanes that rotate
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # one ratio per layer, backbone layers first, then the DSpark stages (spec attention §1.1)
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_seq_len: int = 65536
    cache_quant: CacheQuant = field(default_factory=CacheQuant)
    # which implementation runs the cache-format and candidate-selection passes (ARCHITECTURE decision 10):
    # "xla" (the jnp reference) or "pallas" (pallas_kernels: Mosaic GPU on GPU, Mosaic TPU on TPU, interpreted
    # on CPU). The kernels are bit-exact on their inputs; around them XLA:GPU may round its neighbouring ops
    # differently (logits within ~1e-6 on the H200). A runtime choice, not part of the HF config.json.
    kernel_backend: str = "xla"

    @property
    def candidate_pool_min(self) -> int:
        # the pinned newest block may hold a single visible entry (spec attention §6.2)
        return self.candidate_topk_blocks * self.candidate_block_size - (self.candidate_block_size - 1)


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    moe_inter_dim: int = 2304
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    norm_topk_prob: bool = True
    gate_temp: float = 1.0
    # the routed experts' grouped matmul (dsv41_jax.model.moe.grouped_matmul): auto = `pallas` on GPU in bf16
    # (Triton kernels over the groups' own rows, pallas_kernels.grouped_matmul, forward and both gradients), else
    # lax.ragged_dot; or force `xla` / `tokamax` (its forward kernel, extra `gpu`) / `pallas`
    grouped_matmul: str = "auto"
    # how the routed experts are read (dsv41_jax.model.moe.routed_path): auto = gather only the picked experts'
    # weights when that moves fewer bytes than reading all of them (decode), else on GPU every expert on every
    # token up to 128 tokens (dense), else the grouped matmul; or force `gather` / `dense` / `grouped`
    routed_path: str = "auto"


@dataclass(frozen=True)
class MHCConfig:
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # speed, not math: on GPU a Sinkhorn over at most this many matrices (a decode step, a short chunk) is
    # unrolled into one kernel a site instead of 19 host-launched loop trips (dsv41_jax.model.mhc.sinkhorn);
    # it costs compile time (the engine-bench decode step: 32 -> 135 s on an H100). 0: always the loop
    sinkhorn_unroll_rows: int = 1024


@dataclass(frozen=True)
class EngramConfig:
    layer_ids: tuple[int, ...] = (1, 14)
    num_embeddings: tuple[int, ...] = (384006168, 384016682)
    max_ngram_size: int = 4
    vocab_size: int = 16000000  # the prime search starts below this (spec model §6.3)
    n_heads: int = 8
    head_dim: int = 256
    pad_id: int = 2
    compressed_vocab_size: int = 99092

    @property
    def n_orders(self) -> int:
        return self.max_ngram_size - 1

    @property
    def n_columns(self) -> int:
        return self.n_orders * self.n_heads


@dataclass(frozen=True)
class DSparkConfig:
    n_layers: int = 3
    block_size: int = 5
    noise_token_id: int = 128799
    target_layer_ids: tuple[int, ...] = (37, 38, 39)
    markov_rank: int = 256
    n_routed_experts: int = 128
    n_activated_experts: int = 3


@dataclass(frozen=True)
class VisionConfig:
    n_layers: int = 32
    dim: int = 1024
    n_heads: int = 16
    inter_dim: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_n_token: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 5120
    n_layers: int = 40
    norm_eps: float = 1e-20
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    # precision policy: activations in `dtype`, parameters stored in `param_dtype`; mHC mixing, router,
    # norm statistics, softmax and logits are fp32 regardless (spec model §3, §4, §5)
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    # "native" keeps the release's FP8 / packed-FP4 weights with their E8M0 scales and dequantises them on
    # the fly (spec model §2.2, §2.5); "float" holds every weight in param_dtype
    weight_format: str = "float"
    # run each run of repeated layer groups as one lax.scan over stacked parameters (training and scoring
    # forwards; dsv41_jax.model.transformer.segments): the same values, a program ~2× smaller to compile
    scan_layers: bool = True
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mhc: MHCConfig = field(default_factory=MHCConfig)
    engram: EngramConfig = field(default_factory=EngramConfig)
    dspark: DSparkConfig = field(default_factory=DSparkConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    def __post_init__(self):
        validate(self)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------------------
# validation


# values that must be > 0, by section ("" = the top level); ints among them must be ≥ 1
_POSITIVE = {
    "": ("vocab_size", "dim", "n_layers", "norm_eps"),
    "attention": ("n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size",
                  "candidate_topk_blocks", "candidate_block_size", "index_n_heads", "index_head_dim", "index_topk",
                  "rope_theta", "compress_rope_theta", "rope_factor", "beta_fast", "beta_slow", "original_seq_len"),
    "moe": ("n_routed_experts", "moe_inter_dim", "route_scale", "swiglu_limit", "gate_temp"),
    "mhc": ("hc_mult", "hc_sinkhorn_iters", "hc_eps"),
    "engram": ("vocab_size", "n_heads", "head_dim", "compressed_vocab_size"),
    "dspark": ("block_size", "markov_rank", "n_routed_experts", "n_activated_experts"),
    "vision": ("n_layers", "dim", "n_heads", "inter_dim", "patch_size", "rope_theta", "downsample_ratio",
               "max_n_token", "min_pixels"),
}


@functools.lru_cache(maxsize=64)
def _engram_rows(vocab_size: int, n_layers: int, n_orders: int, n_heads: int) -> tuple[int, ...]:
    from dsv41_jax.engram_hash import engram_primes  # imports this module's package: resolved at call time

    cfg = EngramConfig(layer_ids=tuple(range(n_layers)), num_embeddings=(1,) * n_layers, max_ngram_size=n_orders + 1,
                       vocab_size=vocab_size, n_heads=n_heads)
    return tuple(int(x) for x in engram_primes(cfg).reshape(n_layers, -1).sum(1))


def _check_ranges(cfg: ModelConfig, source: str | None) -> None:
    """Sizes, counts and scales positive; token ids inside the vocabulary; the few ordered pairs in order."""
    for section, keys in _POSITIVE.items():
        sub = getattr(cfg, section) if section else cfg
        for key in keys:
            v = getattr(sub, key)
            if not v > 0:  # also NaN
                name = f"{section}.{key}" if section else key
                fail(f"{name} must be {'≥ 1' if isinstance(v, int) else '> 0'}, got {v}", source)
    if cfg.dspark.n_layers < 0:
        fail(f"dspark.n_layers must be ≥ 0, got {cfg.dspark.n_layers}", source)
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "image_token_id": cfg.image_token_id, "engram.pad_id": cfg.engram.pad_id,
           "dspark.noise_token_id": cfg.dspark.noise_token_id}
    for key, t in ids.items():
        if not 0 <= t < cfg.vocab_size:
            fail(f"{key} {t} is not a token id of the vocabulary [0, {cfg.vocab_size})", source)
    e, a = cfg.engram, cfg.attention
    if any(not v > 0 for v in e.num_embeddings):
        fail(f"engram.num_embeddings must all be ≥ 1, got {list(e.num_embeddings)}", source)
    if e.layer_ids and e.max_ngram_size >= 2 and len(e.num_embeddings) == len(e.layer_ids):
        rows = _engram_rows(e.vocab_size, len(e.layer_ids), e.max_ngram_size - 1, e.n_heads)
        if tuple(e.num_embeddings) != rows:  # else row ids miss the table: gathers clamp, silently wrong
            fail(f"engram.num_embeddings {list(e.num_embeddings)} must be the rows the hash addresses, {list(rows)} "
                 f"(per layer the sum of its primes above engram.vocab_size {e.vocab_size}: max_ngram_size − 1 "
                 "orders × n_heads each, spec model §6.3)", source)
    if a.beta_fast <= a.beta_slow:
        fail(f"attention.beta_fast ({a.beta_fast}) must exceed beta_slow ({a.beta_slow}) (YaRN ramp)", source)
    if a.rope_factor < 1:
        fail(f"attention.rope_factor must be ≥ 1 (YaRN extends the context), got {a.rope_factor}", source)
    d = cfg.dspark
    if d.n_activated_experts > d.n_routed_experts:
        fail(f"dspark.n_activated_experts ({d.n_activated_experts}) must be ≤ dspark.n_routed_experts "
             f"({d.n_routed_experts})", source)
    v = cfg.vision
    if v.dim % v.n_heads:
        fail(f"vision.dim {v.dim} must be divisible by vision.n_heads {v.n_heads}", source)


def validate(cfg: ModelConfig, source: str | None = None) -> None:
    """Reject impossible values and topologies with a message that names the offending key."""
    _check_ranges(cfg, source)
    a, n = cfg.attention, cfg.n_layers
    total = n + cfg.dspark.n_layers
    if cfg.dtype not in ("bfloat16", "float32") or cfg.param_dtype not in ("bfloat16", "float32"):
        fail(f"dtype/param_dtype must be 'bfloat16' or 'float32', got {cfg.dtype!r}/{cfg.param_dtype!r}",
             source)
    if cfg.weight_format not in ("float", "native"):
        fail(f"weight_format must be 'float' or 'native', got {cfg.weight_format!r}", source)
    if cfg.mhc.sinkhorn_unroll_rows < 0:
        fail(f"mhc.sinkhorn_unroll_rows must be >= 0 (0: never unroll), got {cfg.mhc.sinkhorn_unroll_rows}", source)
    if a.kernel_backend not in KERNEL_BACKENDS:
        fail(f"attention.kernel_backend must be one of {', '.join(map(repr, KERNEL_BACKENDS))}, got "
             f"{a.kernel_backend!r}", source)
    if len(a.compress_ratios) != total:
        fail(f"attention.compress_ratios has {len(a.compress_ratios)} entries; expected n_layers + "
             f"dspark.n_layers = {total}", source)
    if any(r not in (0, 1, 2) for r in a.compress_ratios):
        fail(f"attention.compress_ratios must hold only 0, 1 or 2, got {sorted(set(a.compress_ratios))}",
             source)
    if any(r != 0 for r in a.compress_ratios[n:]):
        fail("attention.compress_ratios: DSpark stages (the entries after n_layers) must be 0", source)
    for key in ("kv_source_layers", "index_source_layers"):
        ids = getattr(a, key)
        if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
            fail(f"attention.{key} must be strictly increasing backbone layer ids < {n}, got {list(ids)}",
                 source)
        if any(a.compress_ratios[i] == 0 for i in ids):
            fail(f"attention.{key} names a pure-SWA layer (ratio 0): {list(ids)}", source)
    if not set(a.kv_source_layers) <= set(a.index_source_layers):
        fail("attention.kv_source_layers must all be index sources (a KV source owns the index keys)",
             source)
    for layer in range(n):
        m = a.compress_ratios[layer]
        if m == 0:
            continue
        for key in ("kv_source_layers", "index_source_layers"):
            src = [s for s in getattr(a, key) if s <= layer]
            if not src:
                fail(f"layer {layer} (ratio {m}) comes before any entry of attention.{key}", source)
            if a.compress_ratios[src[-1]] != m:
                fail(f"layer {layer} has ratio {m} but its attention.{key} entry {src[-1]} has ratio "
                     f"{a.compress_ratios[src[-1]]}", source)
    c = a.candidate_source_layer
    if c not in a.kv_source_layers:
        fail(f"attention.candidate_source_layer {c} must be one of kv_source_layers {list(a.kv_source_layers)}",
             source)
    if any(s > c for s in a.kv_source_layers):
        fail("attention.candidate_source_layer must be the last KV source (the decoder's global KV)", source)
    if a.candidate_pool_min < a.index_topk:
        fail(f"candidate pool too small: candidate_topk_blocks·candidate_block_size − (block − 1) = "
             f"{a.candidate_pool_min} < index_topk = {a.index_topk}", source)
    if a.head_dim % 32 or a.index_head_dim % 32:
        fail("attention.head_dim and index_head_dim must be multiples of 32 (FP8/MXFP4 groups)", source)
    if a.rope_head_dim % 2 or a.rope_head_dim > min(a.head_dim, a.index_head_dim):
        fail("attention.rope_head_dim must be even and fit in head_dim and index_head_dim", source)
    if a.n_heads % a.o_groups:
        fail(f"attention.n_heads {a.n_heads} must be divisible by o_groups {a.o_groups}", source)
    e = cfg.engram
    if len(e.layer_ids) != len(e.num_embeddings) or any(not 0 <= i < n for i in e.layer_ids):
        fail("engram.layer_ids must be backbone layers, one engram.num_embeddings entry each", source)
    if e.max_ngram_size < 2 or e.head_dim % 32:
        fail("engram.max_ngram_size must be ≥ 2 and engram.head_dim a multiple of 32", source)
    if any(not 0 <= t < n for t in cfg.dspark.target_layer_ids):
        fail(f"dspark.target_layer_ids must be backbone layers < {n}", source)
    if list(cfg.dspark.target_layer_ids) != sorted(cfg.dspark.target_layer_ids):
        fail(f"dspark.target_layer_ids {list(cfg.dspark.target_layer_ids)} must be in layer order (the features are "
             "concatenated as the stack passes the layers)", source)
    mo = cfg.moe
    if not 0 < mo.n_activated_experts <= mo.n_routed_experts or mo.n_shared_experts != 1:
        fail("moe: need 0 < n_activated_experts ≤ n_routed_experts and exactly one shared expert", source)
    if mo.grouped_matmul not in GROUPED_MATMULS:
        fail(f"moe.grouped_matmul must be one of {', '.join(map(repr, GROUPED_MATMULS))}, got "
             f"{mo.grouped_matmul!r}", source)
    if mo.routed_path not in ROUTED_PATHS:
        fail(f"moe.routed_path must be one of {', '.join(map(repr, ROUTED_PATHS))}, got {mo.routed_path!r}",
             source)
    if mo.score_func != "sqrtsoftplus":
        fail(f"moe.score_func {mo.score_func!r} is not supported; V4.1 uses 'sqrtsoftplus'", source)
