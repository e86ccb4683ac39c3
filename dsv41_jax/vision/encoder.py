"""DeepSeek-ViT, the 3×3 aligner and the span delimiter vectors: images to rows of the LLM's width.

The module tree is named like the release checkpoint (``vision.blocks.0.attn.wqkv.weight``, ``aligner.w1.bias``,
``image_start``), so :func:`dsv41_jax.checkpoint.tree.assign` fills it from a converted or release checkpoint.

Precision (spec model §3.1, §7): linears compute in the activation dtype with fp32 accumulation and the bias
added before the one rounding; RMSNorm statistics (ε 1e-6) and the RoPE rotation are fp32, cast back; the
attention softmax is fp32. With ``dtype="float32"`` everything is fp32 (the golden's clean-math mode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from dsv41_jax.config import VisionConfig
from dsv41_jax.model.layers import RMSNorm, normal
from dsv41_jax.sharding import param

VISION_NORM_EPS = 1e-6  # spec model §3.1: vision RMSNorm
PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")  # its checkpoint names


class BiasLinear(nnx.Module):
    """``y = x · Wᵀ (+ b)``, W [out, in] like the checkpoint; fp32 accumulation, one rounding to ``dtype``."""

    def __init__(self, d_in: int, d_out: int, role: str, *, bias: bool, dtype, param_dtype, rngs: nnx.Rngs):
        self.weight = param(role, normal(rngs, (d_out, d_in), d_in ** -0.5, param_dtype))
        if bias:
            self.bias = param(role + "_bias", jnp.zeros((d_out,), param_dtype))
        self.dtype = dtype

    def __call__(self, x: Float[Array, "*B X"]) -> Float[Array, "*B Y"]:
        y = jnp.einsum("...x,yx->...y", x.astype(self.dtype), self.weight[...].astype(self.dtype),
                       preferred_element_type=jnp.float32)
        if hasattr(self, "bias"):
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


def rope_tables(n_h: int, n_w: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """fp32 cos, sin [n_h·n_w, head_dim/2] of the 2-D RoPE (spec model §7.1): a patch at (row r, col c) has
    angles ``[r·inv_freq, c·inv_freq]`` with ``inv_freq[k] = θ^(−2k/(head_dim/2))``, k < head_dim/4."""
    rope_dim = head_dim // 2
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim))))
    inv_freq = inv_freq.astype(np.float32)
    rows, cols = np.meshgrid(np.arange(n_h, dtype=np.float32), np.arange(n_w, dtype=np.float32), indexing="ij")
    ang = np.concatenate([rows.reshape(-1, 1) * inv_freq, cols.reshape(-1, 1) * inv_freq], axis=-1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rotate_half(x: Float[Array, "I T N H"], cos: Float[Array, "T R"], sin: Float[Array, "T R"]
                ) -> Float[Array, "I T N H"]:
    """Channel i pairs with i + H/2 at angle i (rotate-half; the LLM's RoPE pairs adjacent channels)."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: VisionConfig, **kw):
        self.wqkv = BiasLinear(cfg.dim, 3 * cfg.dim, "vit_up", bias=True, **kw)
        self.wo = BiasLinear(cfg.dim, cfg.dim, "vit_down", bias=True, **kw)
        self.n_heads = cfg.n_heads

    def __call__(self, x: Float[Array, "I T D"], cos, sin) -> Float[Array, "I T D"]:
        i, t, d = x.shape
        q, k, v = (a.reshape(i, t, self.n_heads, -1) for a in jnp.split(self.wqkv(x), 3, axis=-1))
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        # full bidirectional attention over one image, scale 1/sqrt(H), softmax in fp32
        o = jax.nn.dot_product_attention(q, k, v)
        return self.wo(o.reshape(i, t, d))


class MLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, **kw):
        self.w1 = BiasLinear(cfg.dim, 2 * cfg.inter_dim, "vit_up", bias=False, **kw)  # [gate; up]
        self.w2 = BiasLinear(cfg.inter_dim, cfg.dim, "vit_down", bias=False, **kw)

    def __call__(self, x: Float[Array, "I T D"]) -> Float[Array, "I T D"]:
        gate, up = jnp.split(self.w1(x), 2, axis=-1)
        return self.w2(jax.nn.silu(gate.astype(jnp.float32)).astype(x.dtype) * up)


class Block(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, param_dtype, **kw):
        self.norm1 = RMSNorm(cfg.dim, VISION_NORM_EPS, param_dtype=param_dtype)
        self.attn = Attention(cfg, param_dtype=param_dtype, **kw)
        self.norm2 = RMSNorm(cfg.dim, VISION_NORM_EPS, param_dtype=param_dtype)
        self.mlp = MLP(cfg, param_dtype=param_dtype, **kw)

    def __call__(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nnx.Module):
    def __init__(self, cfg: VisionConfig, **kw):
        self.proj = BiasLinear(3 * cfg.patch_size ** 2, cfg.dim, "vit_patch", bias=True, **kw)


class ViT(nnx.Module):
    """32 pre-norm blocks with 2-D RoPE, no position embedding, no [CLS]; final RMSNorm (spec model §7.1)."""

    def __init__(self, cfg: VisionConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.patch_embed = PatchEmbed(cfg, **kw)
        self.blocks = nnx.List([Block(cfg, **kw) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, VISION_NORM_EPS, param_dtype=param_dtype)
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, patches: Float[Array, "I T C P Q"], n_h: int, n_w: int) -> Float[Array, "I T D"]:
        """Patches of ``I`` images of one ``n_h`` × ``n_w`` grid, row-major, (channel, row, col) inside."""
        i, t = patches.shape[:2]
        if t != n_h * n_w:
            raise ValueError(f"{t} patches do not form the {n_h}x{n_w} grid")
        cos, sin = rope_tables(n_h, n_w, self.cfg.dim // self.cfg.n_heads, self.cfg.rope_theta)
        x = self.patch_embed.proj(patches.reshape(i, t, -1).astype(self.dtype))
        for block in self.blocks:
            x = block(x, jnp.asarray(cos), jnp.asarray(sin))
        return self.norm(x)


def unshuffle(x: Float[Array, "I T C"], n_h: int, n_w: int, r: int) -> Float[Array, "I L F"]:
    """3×3 pixel-unshuffle (spec model §7.2): the grid zero-padded bottom/right to multiples of ``r``, blocks in
    row-major order, features channel-major then kernel row then kernel column (index c·r² + r·dy + dx)."""
    i, _, c = x.shape
    g = x.reshape(i, n_h, n_w, c)
    g = jnp.pad(g, ((0, 0), (0, -n_h % r), (0, -n_w % r), (0, 0)))
    hb, wb = g.shape[1] // r, g.shape[2] // r
    g = g.reshape(i, hb, r, wb, r, c).transpose(0, 1, 3, 5, 2, 4)  # [I, hb, wb, C, dy, dx]
    return g.reshape(i, hb * wb, c * r * r)


class Aligner(nnx.Module):
    def __init__(self, cfg: VisionConfig, dim: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.w1 = BiasLinear(cfg.dim * cfg.downsample_ratio ** 2, dim, "aligner_in", **kw)
        self.w2 = BiasLinear(dim, dim, "aligner_out", **kw)
        self.r = cfg.downsample_ratio

    def __call__(self, x: Float[Array, "I T C"], n_h: int, n_w: int) -> Float[Array, "I L D"]:
        h = self.w1(unshuffle(x, n_h, n_w, self.r))
        return self.w2(jax.nn.gelu(h.astype(jnp.float32), approximate=False).astype(h.dtype))  # exact erf GELU


class VisionEncoder(nnx.Module):
    """The ViT, the aligner and the three delimiter vectors, named as in the checkpoint."""

    def __init__(self, cfg: VisionConfig, dim: int, *, dtype: str = "bfloat16", param_dtype: str = "float32",
                 rngs: nnx.Rngs):
        add_tower(self, cfg, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.cfg, self.dtype = cfg, jnp.dtype(dtype)

    def __call__(self, patches: Float[Array, "I T C P Q"], n_h: int, n_w: int
                 ) -> tuple[Float[Array, "I T E"], Float[Array, "I L D"]]:
        """(ViT output after its final norm, aligner rows in reading order) of images of one grid."""
        return encode(self, patches, n_h, n_w)

    def delimiters(self) -> tuple[Float[Array, " D"], Float[Array, " D"], Float[Array, " D"]]:
        return delimiters(self)


def add_tower(module: nnx.Module, cfg: VisionConfig, dim: int, *, dtype, param_dtype, rngs: nnx.Rngs) -> None:
    """Give ``module`` the tower's attributes, named as in the checkpoint: ``vision``, ``aligner``, ``image_*``."""
    dt, pdt = jnp.dtype(dtype), jnp.dtype(param_dtype)
    module.vision = ViT(cfg, dtype=dt, param_dtype=pdt, rngs=rngs)
    module.aligner = Aligner(cfg, dim, dtype=dt, param_dtype=pdt, rngs=rngs)
    for name in ("image_start", "image_end", "image_newline"):
        setattr(module, name, param("image_delimiter", normal(rngs, (dim,), 0.12, pdt)))


def encode(module: nnx.Module, patches, n_h: int, n_w: int):
    """(ViT output, aligner rows) through ``module``'s tower (:func:`add_tower`)."""
    vit = module.vision(patches, n_h, n_w)
    return vit, module.aligner(vit, n_h, n_w)


def delimiters(module: nnx.Module):
    return module.image_start[...], module.image_end[...], module.image_newline[...]
