"""Attention over the paged KV cache: the step's attention (prefill chunks, batched decodes), the
custom op that is the compiled forward's seam, the decode kernels (gather + SDPA, FlexAttention
reading the pool in place), SDPA's extras, windows, and one layer's paged KV cache."""
