"""The decode mask: which tokens each constrained row (--json-schema, --choice, --regex; their
grammars and matchers: engine/constraints.py) may draw this step, from the matchers to the
logits, in one object and two hops:

    Engine._step -> ModelRunner.execute(plan, mask)         the engine's (None: no grammars)
    ModelRunner._execute -> DecodeMask.apply(logits, rows)  after penalties, before sampling

`apply` builds the step's packed bitmask on the host (32 tokens a word: bit j of word i allows
token 32i+j), a row for each sampled row in the order the runner packed them (so nothing is
reordered), each constrained row's matcher filling its own and every other row allowing all;
copies it to the device once; and sets the logits of the tokens it leaves out to -inf, in place
(xgrammar's kernel: on the CPU 0.04 ms for 64 rows x 32k vocab, against 5 ms for the same as
tensor ops), as the penalties are. The sampler (engine/step_sampling.py, the compiled sampling
graph) takes masked logits and no mask, so a step with no constrained row pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.engine.constraints import Constrainer
from batchgen.engine.sequence import SeqState


def apply_words(logits: torch.Tensor, words: torch.Tensor) -> None:
    """logits (B, V) float32, in place; words (B, ceil(V/32)) int32 on logits' device, bit j of
    word i allows token 32i+j. Disallowed tokens get -inf."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, words)


class DecodeMask:
    """Builds each step's allowed-token mask from the constrained rows' matchers and applies it
    to the step's logits (the module's docstring)."""

    def __init__(self, constrainer: Constrainer) -> None:
        self.constrainer = constrainer

    def build(self, rows: Sequence[SeqState]) -> torch.Tensor | None:
        """(rows, words) int32 masks on the host in the order of rows; None if no row is
        constrained. A row whose mask allows nothing is the Constrainer's to fail (`fill`)."""
        if not any(seq.params.constraint is not None for seq in rows):
            return None
        words = torch.full((len(rows), self.constrainer.grammars.mask_words), -1, dtype=torch.int32)
        self.constrainer.fill(words, rows)
        return words

    def apply(self, logits: torch.Tensor, rows: Sequence[SeqState]) -> None:
        """Mask logits (rows, V), the sampled rows' in the runner's packed order, in place:
        tokens outside a constrained row's grammar get -inf; other rows are left as they are."""
        words = self.build(rows)
        if words is not None:
            apply_words(logits, words.to(logits.device))
