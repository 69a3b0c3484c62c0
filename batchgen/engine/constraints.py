"""Structured outputs: a row's output held to a choice list, a regex or a JSON schema.

Grammars are compiled by xgrammar (what vLLM and SGLang use by default) against the
model's vocabulary. Each constrained sequence gets a matcher; before a step samples, every
constrained row's matcher writes the tokens it allows into the step's packed bitmask (32 tokens
a word), which engine/decode_mask.py builds and applies to the logits on the device; steps with
no constrained row build none. EOS is allowed only where the grammar accepts. A row that
reaches max_new_tokens before its grammar completes ends with finish_reason "length", as in
vLLM, and a note that it is incomplete.

What a row must never get is a `stop` that breaks its constraint. So a constraint whose first
mask is empty (it matches no text the vocabulary can write) is refused when it compiles; a row
whose mask empties later, or whose matcher refuses the token its mask allowed, is an error; and
JSON grammars are patched where xgrammar lets raw control characters into strings.

Choice labels and word boundaries: BPE tokenizers keep a word's leading space in its token, so
after "Sentiment:" a model writes " positive", and a grammar of the bare "positive" forced
2 of 50 sample rows right (issue 31). The rule: a label written with no leading whitespace also
matches its space-prefixed form where the row's prompt does not end in whitespace
(`word_boundary`), and the output is the label as written (`as_written`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from typing import Any

import torch

from batchgen.engine.sequence import Constraint, ConstraintKind, SeqState


class ConstraintError(ValueError):
    """A choice list, regex or JSON schema that cannot be compiled, or never be met."""


class Verdict(enum.Enum):
    """What a constrained row's grammar made of its newest token."""

    GOING = "going"  # accepted; the output is not a complete match yet
    COMPLETE = "complete"  # accepted; the output so far is a complete match (EOS may end it)
    ENDED = "ended"  # accepted EOS: the row is done
    STUCK = "stuck"  # the row's mask allowed no token at all: nothing can continue it
    REFUSED = "refused"  # the matcher refused a token its own mask allowed (a library bug)

    def error(self, seq: SeqState) -> str:
        """The error of a row whose grammar got stuck or refused its token."""
        if self is Verdict.STUCK:
            return (
                f"{seq.params.constraint.describe()} cannot be met: after "
                f"{seq.num_generated - 1} tokens no token of the vocabulary continues it"
            )
        return (
            f"the grammar library refused token {seq.token_ids[-1]}, which its own mask allowed "
            "(a grammar library bug); rerun the row with another seed"
        )


# The note of a constrained row cut at max_new_tokens: its text is kept, but it is no answer.
INCOMPLETE = "output cut at max_new_tokens; it does not complete the constraint"


_CONTROLS = r"\0-\x1f"  # U+0000-U+001F, as xgrammar's EBNF writes a range


def exclude_controls(ebnf: str) -> str:
    """ebnf with U+0000-U+001F added to every negated character class outside quoted text.

    xgrammar 0.2.9 writes the characters of a JSON string with minLength/maxLength as a class
    that leaves out only the quote, the backslash, CR and LF, which lets a byte-level
    vocabulary's control-byte tokens into a string: JSON forbids them unescaped (measured: 5-14
    of 32 sampled rows broke `json.loads`). In a JSON-schema grammar every negated class is a
    string's characters, so each gets the range."""
    out, i, quoted = [], 0, False
    while i < len(ebnf):
        ch = ebnf[i]
        if ch == "\\":  # an escape, inside quotes or a class: copied as is
            out.append(ebnf[i : i + 2])
            i += 2
            continue
        if ch == '"':
            quoted = not quoted
        elif not quoted and ebnf.startswith("[^", i) and not ebnf.startswith(_CONTROLS, i + 2):
            out.append("[^" + _CONTROLS)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def parse_choices(value: str | Sequence[str]) -> tuple[str, ...]:
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


def word_boundary(c: Constraint) -> Constraint:
    """c, for a prompt that does not end in whitespace: a choice whose labels written with no
    leading whitespace may also be written after one space (the flag a choice never needs
    otherwise, any_whitespace, marks it). Other constraints are returned as they are."""
    if c.kind is not ConstraintKind.CHOICE or not any(_bare(s) for s in c.spec):
        return c
    return Constraint(c.kind, c.spec, any_whitespace=True)


def as_written(c: Constraint | None, text: str) -> str:
    """A choice row's output as its label is written (" positive" -> "positive" where the label
    is "positive" and word_boundary let the space in); any other text as it is."""
    if c is None or c.kind is not ConstraintKind.CHOICE or not c.any_whitespace:
        return text
    if text not in c.spec and text.startswith(" ") and text[1:] in c.spec:
        return text[1:]
    return text


def _bare(label: str) -> bool:
    return not label[:1].isspace()


def _choice_alternatives(c: Constraint) -> list[str]:
    """The strings a choice grammar accepts: the labels, and with word_boundary the bare ones
    after a space too (unless that is a label itself)."""
    alts = list(c.spec)
    if c.any_whitespace:
        alts += [" " + s for s in c.spec if _bare(s) and " " + s not in c.spec]
    return alts


class Grammars:
    """Compiles constraints for one tokenizer (cached), and makes their matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
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
                alts = " | ".join(
                    json.dumps(s, ensure_ascii=False) for s in _choice_alternatives(c)
                )
                compiled = self._compiler.compile_grammar(f"root ::= {alts}")
            elif c.kind is ConstraintKind.REGEX:
                compiled = self._compiler.compile_regex(c.spec)
            else:
                json.loads(c.spec)  # a clear message for text that is not JSON at all
                # Compact by default: free whitespace lets a model loop on "{\n\n\n..." until
                # max_new_tokens (the embedded model did, on every row).
                g = xgr.Grammar.from_json_schema(c.spec, any_whitespace=c.any_whitespace)
                g = xgr.Grammar.from_ebnf(exclude_controls(str(g)))
                compiled = self._compiler.compile_grammar(g)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with a long text
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConstraintError(f"{c.describe()} does not compile: {first}") from None
        if not self._first_mask_allows_any(compiled):
            raise ConstraintError(
                f"{c.describe()} cannot be met: it matches no text this model's vocabulary can "
                "write (no first token is allowed); fix the constraint"
            )
        self._compiled[c] = compiled
        return compiled

    def _first_mask_allows_any(self, compiled: Any) -> bool:
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
        return bool(mask.any())

    def matcher(self, c: Constraint) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(c))


class Constrainer:
    """The matchers of the constrained sequences in flight."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._matchers: dict[int, Any] = {}  # by request index
        self._stuck: set[int] = set()  # request indices whose last mask allowed no token

    def fill(self, words: torch.Tensor, rows: Sequence[SeqState]) -> None:
        """Each constrained row's matcher writes the tokens it allows into its row of words
        (rows, mask_words), the step's decode mask (engine/decode_mask.py); other rows are left
        as they are. Rows whose mask is empty are remembered as stuck: whatever they sample,
        `accept` fails them."""
        for i, seq in enumerate(rows):
            if seq.params.constraint is not None:
                self._matcher(seq).fill_next_token_bitmask(words, i)
        empty = (words == 0).all(dim=1).tolist()
        self._stuck = {seq.request.index for seq, e in zip(rows, empty, strict=True) if e}

    def accept(self, seqs: Sequence[SeqState]) -> dict[SeqState, Verdict]:
        """Feed each constrained sequence its newest token (also one the scheduler ended the
        row with: EOS, or the last before max_new_tokens) and say what its grammar made of it.
        A matcher refuses a token its own mask allowed rarely (xgrammar 0.2.9: e.g. `-` and a
        UTF-8 lead byte where a JSON integer starts, measured by scripts/bench_grammars.py)."""
        out = {}
        for seq in seqs:
            if seq.params.constraint is None:
                continue
            m = self._matcher(seq)
            if seq.request.index in self._stuck:
                out[seq] = Verdict.STUCK
            elif not m.accept_token(seq.token_ids[-1]):
                out[seq] = Verdict.REFUSED
            elif m.is_terminated():
                out[seq] = Verdict.ENDED
            else:
                out[seq] = Verdict.COMPLETE if m.is_completed() else Verdict.GOING
        return out

    def final_error(self, c: Constraint, text: str, cut: bool) -> str | None:
        """Why a row's final text (ended `stop`) fails c, or None: a JSON row's text must parse
        strictly (a last net under the grammar), and one a stop string cut must still be a
        complete match (a fresh matcher replays it)."""
        if cut:
            m = self.grammars.matcher(c)
            if not (m.accept_string(text) and m.is_completed()):
                return "a stop string cut the output before it completes the constraint"
        if c.kind is ConstraintKind.JSON_SCHEMA:
            try:
                json.loads(text)  # strict: no raw control characters in strings
            except ValueError as e:
                return f"the output is not valid JSON ({e}); a grammar library bug"
        return None

    def release(self, seq: SeqState) -> None:
        self._matchers.pop(seq.request.index, None)

    def clear(self) -> None:
        """Forget every row's matcher (Engine.abort)."""
        self._matchers.clear()
        self._stuck.clear()

    def _matcher(self, seq: SeqState) -> Any:
        m = self._matchers.get(seq.request.index)
        if m is None:
            m = self._matchers[seq.request.index] = self.grammars.matcher(seq.params.constraint)
        return m
