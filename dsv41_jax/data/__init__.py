"""Data for pre-training: documents, the trained tokenizer, and the grain packing pipeline."""
