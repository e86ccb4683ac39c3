"""The vision path: image processor, DeepSeek-ViT + aligner, and image spans in the token stream (spec model §7)."""

from dsv41_jax.vision.encoder import VisionEncoder
from dsv41_jax.vision.processor import ProcessedImage, plan_image_grid, process_image
from dsv41_jax.vision.spans import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEW_LINE,
    IMAGE_START,
    TEXT,
    expand_prompt,
    image_token_types,
    span_embeddings,
)

__all__ = ["IMAGE", "IMAGE_END", "IMAGE_NEW_LINE", "IMAGE_START", "TEXT", "ProcessedImage", "VisionEncoder",
           "expand_prompt", "image_token_types", "plan_image_grid", "process_image", "span_embeddings"]
