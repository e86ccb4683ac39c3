"""Named model configs: the released V4.1-Flash and the tiny test model with every layer role."""

from __future__ import annotations

from dsv41_jax.config.schema import (
    AttentionConfig,
    ConfigError,
    DSparkConfig,
    EngramConfig,
    ModelConfig,
    MoEConfig,
    VisionConfig,
)


def v41_flash() -> ModelConfig:
    """The released DeepSeek-V4.1-Flash (spec model §1.1)."""
    return ModelConfig()


def tiny() -> ModelConfig:
    """Every layer role of the release at toy width; equals the golden checkpoint's config.

    Window (8) < top-k (16) < candidate pool (29) < visible entries at a few hundred tokens, so every
    selection binds in tests.
    """
    return ModelConfig(
        vocab_size=512, dim=64, n_layers=12, image_token_id=3,
        attention=AttentionConfig(
            n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32,
            window_size=8, compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0),
            kv_source_layers=(2, 4, 6), index_source_layers=(2, 4, 6, 8, 10), candidate_source_layer=6,
            candidate_topk_blocks=8, candidate_block_size=4, index_n_heads=16, index_head_dim=64, index_topk=16),
        moe=MoEConfig(n_routed_experts=8, n_activated_experts=2, moe_inter_dim=64),
        engram=EngramConfig(layer_ids=(1, 4), num_embeddings=(434, 606), vocab_size=61, n_heads=2, head_dim=32,
                            compressed_vocab_size=391),
        dspark=DSparkConfig(noise_token_id=500, target_layer_ids=(9, 10, 11), markov_rank=32,
                            n_routed_experts=4, n_activated_experts=3),
        vision=VisionConfig(n_layers=1, dim=64, n_heads=2, inter_dim=96),
    )


PRESETS = {"v41_flash": v41_flash, "tiny": tiny}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
