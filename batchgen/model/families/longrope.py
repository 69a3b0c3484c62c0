"""LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): two sets of RoPE frequencies, one for rows within
the model's original context and one for rows beyond it.

Each frequency of the default RoPE is divided by a per-frequency factor: `short_factor` for a
row of at most `original_max_position_embeddings` tokens, `long_factor` for a longer one; cos
and sin are both scaled by the attention factor, sqrt(1 + ln(s) / ln(original)) with s =
max_position_embeddings / original (or the config's own), whichever set is used.

Which set: transformers picks one per forward, from the largest position in the batch
(`longrope_frequency_update`), so in a padded batch every row takes the long factors as soon as
one row is long, and a row's tokens depend on what it was batched with. batchgen decides per
row, as transformers decides for that row run alone by generate: a row of more than `original`
tokens (its prompt and what it has generated so far) runs on the long factors, every token of
it; a shorter row on the short ones. Where a short row grows past the original context,
transformers' Phi-3 drops its cache and runs the whole row again
(`Phi3ForCausalLM.prepare_inputs_for_generation`); so does batchgen: the engine preempts the
row to recompute it (engine/engine.py `_recompute_grown_rows`), its keys now on the long factors. A
row's set therefore flips once, at the same token as transformers', and a row recomputed after
a preemption gets the set it had.

The tables hold both sets, (2 * max_positions, rotary_dim): the short factors' at rows
0..P - 1, the long factors' at P..2P - 1; the step packer (engine/step_inputs.py) hands each
token its row in place of its position (config.LongRopeRows), so the forward and its compiled
graph are unchanged. A long row's cached blocks hold other keys than a short row's of the same
tokens: its requests get another prefix-cache salt (Request.cache_salt), and share blocks only
with other long rows.
"""

from __future__ import annotations

import torch

from batchgen.model.config import RopeScaling


def longrope_inv_frequencies(
    rotary_dim: int, theta: float, factors: tuple[float, ...]
) -> torch.Tensor:
    # transformers' _compute_longrope_parameters, expression for expression (bit-equal tables)
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (ext * theta**shape)


def longrope_tables(
    max_positions: int, rotary_dim: int, theta: float, scaling: RopeScaling, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (2 * max_positions, rotary_dim) float32: the short factors' rows,
    then the long factors'; both times the attention factor."""
    t = torch.arange(max_positions, device=device, dtype=torch.float32)
    cos, sin = [], []
    for factors in (scaling.short_factor, scaling.long_factor):
        inv_freq = longrope_inv_frequencies(rotary_dim, theta, factors).to(device)
        freqs = torch.outer(t, inv_freq)  # (P, R/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, R)
        cos.append(emb.cos() * scaling.attention_factor)
        sin.append(emb.sin() * scaling.attention_factor)
    return torch.cat(cos), torch.cat(sin)
