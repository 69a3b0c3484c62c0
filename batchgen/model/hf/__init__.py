"""The transformers backend (`--model-impl transformers`): which models it serves and refuses, the
model loaded by transformers on batchgen's attention and KV cache, and LoRA on it."""
