"""A step's scored positions -> log-probabilities: the runner's one hook for prefill-only
scoring (a score task's candidates, a row's prompt logprobs).

The LM head runs on the scored positions of this step's chunks only, so the logits are at
most (max_num_batched_tokens, vocab) whatever a prompt's length: a 32k-token prompt is
scored chunk by chunk, as it is prefilled (vLLM's prompt logprobs ran out of memory on long
prompts: vllm#5907). Within a step the log-softmax runs over slices of `SLICE_ROWS` rows, so
the float32 copy it makes stays small beside the logits themselves.
"""

from __future__ import annotations

import torch

from batchgen.engine.sequence import ScoredChunk, StepPlan, TopLogprobs

# Rows a log-softmax runs over at once: 256 x a 32k vocabulary is 32 MiB of float32.
SLICE_ROWS = 256


def _top_k(plan: StepPlan) -> list[int]:
    """Each scored chunk's alternatives asked for, in plan order (0: none)."""
    return [
        s.seq.params.prompt_logprobs or 0 for s in plan.prefills if s.seq.request.scored is not None
    ]


def score_rows(
    logits: torch.Tensor, targets: list[int], chunks: list[list[int]], plan: StepPlan
) -> list[ScoredChunk]:
    """logits: (rows, vocab), the scored positions' in the order of chunks (each chunk's
    rows); targets: the token each row scores. Returns each chunk's log-probabilities of its
    targets and, where its row asks (`params.prompt_logprobs`), its rows' top alternatives."""
    ks = _top_k(plan)
    if not targets:
        return [ScoredChunk([]) for _ in chunks]
    want = torch.tensor(targets, device=logits.device)
    # each row's k: the rows of a chunk share their sequence's
    row_k = [k for rows, k in zip(chunks, ks, strict=True) for _ in rows]
    k_max = max(row_k)
    lps, top_v, top_i = [], [], []
    for lo in range(0, len(targets), SLICE_ROWS):
        lp = logits[lo : lo + SLICE_ROWS].float().log_softmax(-1)  # (rows, vocab)
        lps.append(lp.gather(-1, want[lo : lo + SLICE_ROWS, None])[:, 0])
        if k_max:
            v, i = lp.topk(k_max, dim=-1)  # (rows, k_max), best first
            top_v.append(v)
            top_i.append(i)
    scored = torch.cat(lps).tolist()  # the host read
    tops: list[TopLogprobs | None] = [None] * len(targets)
    if k_max:
        values, ids = torch.cat(top_v).tolist(), torch.cat(top_i).tolist()
        rows = zip(ids, values, row_k, strict=True)
        tops = [list(zip(i[:k], v[:k], strict=True)) for i, v, k in rows]
    out, at = [], 0
    for rows, k in zip(chunks, ks, strict=True):
        end = at + len(rows)
        out.append(ScoredChunk(scored[at:end], tops[at:end] if k else None))
        at = end
    return out
