"""Checkpoint directories -> a built model's weights: the files, each family's tensor names (MoE
experts, multimodal wrappers' text model), what the stored weights are (pre-quantized formats,
activation quantization), what loading leaves out, the loader, and LoRA adapters merged into the
weights."""
