"""The native decoder and its families: the transformer (GPT-2, Llama, Mistral, Qwen, MoE
variants), Gemma, the MoE MLP, RoPE and LongRoPE, activations, the CPU's packed linears; and
config.json -> ModelConfig per family."""
