"""Structured outputs: a row's output held to a choice list, a regex or a JSON schema.

Grammars are compiled by xgrammar (what vLLM and SGLang use by default) against the
model's vocabulary. Each constrained sequence gets a matcher; before a step samples, every
constrained row's matcher writes the tokens it allows into a packed bitmask (32 tokens a
word), which the runner applies to the logits on the device (`apply_bitmask`), so the step
stays one graph and unconstrained steps pass no mask at all. EOS is allowed only where the
grammar accepts. A row that reaches max_new_tokens before its grammar completes ends with
finish_reason "length", as in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from typing import Any

import torch

from batchgen.engine.sequence import Constraint, ConstraintKind, Sequence, StepPlan


class ConstraintError(ValueError):
    """A choice list, regex or JSON schema that cannot be compiled."""


def parse_choices(value: str | Seq[str]) -> tuple[str, ...]:
    """A comma-separated string ("a, b": spaces around labels dropped) or a list of labels,
    kept exactly (" positive" keeps its space: a label often follows "Sentiment:") -> the
    labels (non-empty, unique)."""
    if isinstance(value, str):
        labels = tuple(s.strip() for s in value.split(",") if s.strip())
    else:
        labels = tuple(str(s) for s in value if str(s).strip())
    if not labels:
        raise ConstraintError("choice: give at least one non-empty label")
    if len(set(labels)) != len(labels):
        raise ConstraintError(f"choice: a label is listed twice in {list(labels)}")
    return labels


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (B, V) float32; bitmask (B, ceil(V/32)) int32, bit j of word i allows token
    32i+j. Disallowed tokens get -inf. Eagerly, xgrammar's kernel, in place (measured on the
    CPU, 64 rows x 32k vocab: 0.04 ms against 5 ms for the tensor ops below); traced, tensor
    ops that compile into the step's graph (and its CUDA graph)."""
    if not torch.compiler.is_compiling():
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        return logits
    return unpack_and_mask(logits, bitmask)


def unpack_and_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """apply_bitmask as plain tensor ops (what the compiled step runs)."""
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


class Grammars:
    """Compiles constraints for one tokenizer (cached), and makes their matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Seq[int]) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = list(eos_ids)
        self._compiler = None
        self._compiled: dict[Constraint, Any] = {}

    @property
    def mask_words(self) -> int:
        return -(-self.vocab_size // 32)

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar of c; ConstraintError (one line) if it does not compile."""
        if c in self._compiled:
            return self._compiled[c]
        import xgrammar as xgr

        if not self.eos_ids:
            raise ConstraintError(
                "constrained outputs need the model's EOS token to end a row, and this "
                "tokenizer has none"
            )
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids
            )
            self._compiler = xgr.GrammarCompiler(info)
        try:
            if c.kind is ConstraintKind.CHOICE:
                alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in c.spec)
                compiled = self._compiler.compile_grammar(f"root ::= {alts}")
            elif c.kind is ConstraintKind.REGEX:
                compiled = self._compiler.compile_regex(c.spec)
            else:
                json.loads(c.spec)  # a clear message for text that is not JSON at all
                compiled = self._compiler.compile_json_schema(c.spec)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with a long text
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConstraintError(f"{c.describe()} does not compile: {first}") from None
        self._compiled[c] = compiled
        return compiled

    def matcher(self, c: Constraint) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(c))


class Constrainer:
    """The matchers of the constrained sequences in flight."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._matchers: dict[int, Any] = {}  # by request index

    def bitmask(self, plan: StepPlan, device: torch.device) -> torch.Tensor | None:
        """(sampling rows of the plan, words) masks in plan order; None if no row is
        constrained (the step then runs unmasked)."""
        rows = [s.seq for s in plan.scheduled if s.samples]
        if not any(seq.params.constraint is not None for seq in rows):
            return None
        mask = torch.full((len(rows), self.grammars.mask_words), -1, dtype=torch.int32)
        for i, seq in enumerate(rows):
            if seq.params.constraint is not None:
                self._matcher(seq).fill_next_token_bitmask(mask, i)
        return mask.to(device)

    def accept(self, seqs: Seq[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Feed each constrained sequence its newest token; returns those whose grammar
        has ended (they accepted EOS), and those whose matcher refused the token its own
        mask allowed (xgrammar 0.2.9 does, rarely: e.g. `-` + a UTF-8 lead byte where a
        JSON integer starts, measured by scripts/bench_grammars.py)."""
        ended, refused = [], []
        for seq in seqs:
            if seq.params.constraint is None:
                continue
            m = self._matcher(seq)
            if not m.accept_token(seq.token_ids[-1]):
                refused.append(seq)
            elif m.is_terminated():
                ended.append(seq)
        return ended, refused

    def release(self, seq: Sequence) -> None:
        self._matchers.pop(seq.request.index, None)

    def _matcher(self, seq: Sequence) -> Any:
        m = self._matchers.get(seq.request.index)
        if m is None:
            m = self._matchers[seq.request.index] = self.grammars.matcher(seq.params.constraint)
        return m
