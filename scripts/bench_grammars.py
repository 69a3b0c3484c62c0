"""xgrammar against llguidance on what batchgen does with a grammar: build the vocabulary
once, compile a constraint, make a matcher per row, then per step fill the next-token
bitmask of a batch of matchers and advance each by one token. Single-threaded, rounds
alternating the variants (A B C D A B C D ...), medians; the allowed token sets of the two
libraries are compared at every step.

    python scripts/bench_grammars.py --rounds 5 --min-steps 300 --markdown out/bench-grammars.md

Variants: `xgr-loop` (GrammarMatcher.fill_next_token_bitmask row by row, batchgen's
Constrainer today), `xgr-batch` (BatchGrammarMatcher, 1 thread), `llg-loop` (LLMatcher row
by row) and `llg-batch` (LLExecutor(1 thread) fill_next_token_bitmask_par and
consume_token_par). The 64 matchers of a batch walk one valid output (the target text's
tokens, then EOS) in step. Tokenizers: `bench` (scripts/bench_models.py llama-55m, a
32000-word word-level vocabulary with no punctuation, so its regex is over its words and
it has no JSON case), `default` (batchgen/assets/default-model, byte-level BPE, 1334
tokens), `bpe-32k` and `bpe-128k` (byte-level BPEs trained here on the venv's Python
sources, the sizes of Llama-2's and Llama-3's vocabularies; cached). outlines-core is not
installable here, so it is not measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_models  # noqa: E402

BATCH = 64
LABELS = (" positive", " negative", " neutral")  # the words the model writes after "Sentiment:"
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "score": {"type": "number"},
            "active": {"type": "boolean"},
            "label": {"enum": [s.strip() for s in LABELS]},
        },
        "required": ["name", "age", "score", "active", "label"],
        "additionalProperties": False,  # xgrammar's strict default, said for llguidance
    }
)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # choice | regex | json
    spec: str | tuple[str, ...]
    target: str  # a valid output: its tokens, then EOS, are the path the matchers walk


TEXT_CASES = (
    Case("choice", "choice", LABELS, " negative"),
    Case("regex", "regex", "[A-Z]{3}-[0-9]{4}", "XKZ-2048"),
    Case(
        "json",
        "json",
        SCHEMA,
        '{"name": "Ada Lovelace", "age": 36, "score": 0.75, "active": true, "label": "neutral"}',
    ),
)
WORD_CASES = (
    Case("choice", "choice", ("t5", "t6", "t7"), "t6"),  # scripts/bench_constraints.py's labels
    # [a-z], not t: llguidance fails where the grammar forces bytes no token spells ("t")
    Case("regex", "regex", "([a-z][0-9]+){8}", "t12 t345 t6 t7890 t11 t22 t333 t4444"),
)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name == "bench":
        path = bench_models.cached("llama-55m", "float32")
    elif name == "default":
        path = HERE.parent / "batchgen" / "assets" / "default-model"
    else:  # bpe-32k, bpe-128k
        path = bpe(int(name.removeprefix("bpe-").removesuffix("k")) * 1000)
    return AutoTokenizer.from_pretrained(path)


def bpe(vocab: int) -> Path:
    """A byte-level BPE of `vocab` tokens trained on the venv's .py files (the first
    vocab x 700 characters of them: 22 MB for 32k), cached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path.home() / ".cache" / "batchgen-bench" / f"bpe-{vocab // 1000}k"
    if (path / "tokenizer.json").exists():
        return path
    site = Path(torch.__file__).parent.parent
    texts, size = [], 0
    for f in sorted(site.rglob("*.py")):
        texts.append(f.read_text(errors="ignore"))
        size += len(texts[-1])
        if size > vocab * 700:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


class Xgr:
    def __init__(self, tok, batch: bool) -> None:
        import xgrammar as xgr

        self.xgr, self.batch = xgr, xgr.BatchGrammarMatcher(max_threads=1) if batch else None
        self.info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id]
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, c: Case):  # as batchgen.engine.constraints.Grammars.compile
        if c.kind == "choice":
            alts = " | ".join(json.dumps(s) for s in c.spec)
            return self.compiler.compile_grammar(f"root ::= {alts}")
        if c.kind == "regex":
            return self.compiler.compile_regex(c.spec)
        return self.compiler.compile_json_schema(c.spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, ms, mask: torch.Tensor) -> None:
        if self.batch is not None:
            self.batch.batch_fill_next_token_bitmask(ms, mask)
        else:
            for i, m in enumerate(ms):
                m.fill_next_token_bitmask(mask, i)

    def accept(self, ms, tokens: list[int]) -> list[bool]:
        if self.batch is not None:
            return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)
        return [m.accept_token(t) for m, t in zip(ms, tokens, strict=True)]

    def done(self, m) -> bool:
        return m.is_terminated()

    def error(self, m) -> str:
        return ""  # xgrammar raises instead


class Llg:
    def __init__(self, tok, batch: bool) -> None:
        import llguidance as llg
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llg, llguidance.torch
        self.executor = llg.LLExecutor(num_threads=1) if batch else None
        if tok.backend_tokenizer.decoder is None:
            # a word-level vocabulary, which llguidance.hf refuses ("can't determine decoder
            # type"): give it the token strings
            self.tok = llg.LLTokenizer(llg.TokenizerWrapper(_Words(tok)), n_vocab=len(tok))
        else:
            self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))

    def compile(self, c: Case):
        """A matcher to copy: LLMatcher() parses the grammar (its lexer is built lazily, as
        masks need it); a deep copy is the cheap way to a matcher for each row."""
        if c.kind == "choice":
            grammar = self.llg.grammar_from("lark", "start: " + " | ".join(map(json.dumps, c.spec)))
        elif c.kind == "regex":
            grammar = self.llg.LLMatcher.grammar_from_regex(c.spec)
        else:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(c.spec)
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, template):
        return template.deep_copy()

    def error(self, m) -> str:
        return m.get_error().splitlines()[0] if m.is_error() else ""

    def fill(self, ms, mask: torch.Tensor) -> None:
        if self.executor is not None:
            self.lt.fill_next_token_bitmask_par(
                self.executor, [(m, i) for i, m in enumerate(ms)], mask
            )
        else:
            for i, m in enumerate(ms):
                self.lt.fill_next_token_bitmask(m, mask, i)

    def accept(self, ms, tokens: list[int]) -> list[bool]:
        if self.executor is not None:
            return self.lt.consume_token_par(self.executor, list(zip(ms, tokens, strict=True)))
        return [m.consume_token(t) for m, t in zip(ms, tokens, strict=True)]

    def done(self, m) -> bool:
        return m.is_stopped()


class _Words:
    """What llguidance's TokenizerWrapper reads, for a vocabulary of plain word strings."""

    def __init__(self, tok) -> None:
        self.eos_token_id, self.bos_token_id = tok.eos_token_id, tok.bos_token_id
        self.special_token_ids = list(tok.all_special_ids)
        self.tokens = [s.encode() for s in tok.convert_ids_to_tokens(list(range(len(tok))))]
        self._ids = {t: i for i, t in enumerate(self.tokens) if i not in self.special_token_ids}
        self._longest = max(map(len, self.tokens))

    def __call__(self, s: bytes) -> list[int]:
        """Longest match over the concatenated words: the HF tokenizer would turn a text
        that is no word ("t", a prefix llguidance asks about) into its unknown token, EOS."""
        ids, i = [], 0
        while i < len(s):
            j = next(
                (j for j in range(min(len(s), i + self._longest), i, -1) if s[i:j] in self._ids), 0
            )
            if not j:
                break
            ids.append(self._ids[s[i:j]])
            i = j
        return ids


VARIANTS = {
    "xgr-loop": lambda tok: Xgr(tok, False),
    "xgr-batch": lambda tok: Xgr(tok, True),
    "llg-loop": lambda tok: Llg(tok, False),
    "llg-batch": lambda tok: Llg(tok, True),
}


def path_of(tok, c: Case) -> list[int]:
    return [*tok.encode(c.target, add_special_tokens=False), tok.eos_token_id]


def allowed(mask_row: torch.Tensor, vocab: int) -> set[int]:
    bits = (mask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


def one_round(lib, tok, c: Case, min_steps: int) -> dict[str, float] | str:
    """Times of the compile, of a first matcher and its mask, of a new matcher, and per
    step (the whole batch) of fill and accept, medians over the walks of this round; or
    the library's error."""
    path, mask = path_of(tok, c), torch.full((BATCH, -(-len(tok) // 32)), -1, dtype=torch.int32)
    t0 = time.perf_counter()
    compiled = lib.compile(c)
    compile_s, t0 = time.perf_counter() - t0, time.perf_counter()
    m = lib.matcher(compiled)
    lib.fill([m], mask[:1])
    first_s = time.perf_counter() - t0
    if lib.error(m):
        return lib.error(m)
    new, fill, accept = [], [], []
    while len(fill) < min_steps:
        t0 = time.perf_counter()
        ms = [lib.matcher(compiled) for _ in range(BATCH)]
        new.append((time.perf_counter() - t0) / BATCH)
        for token in path:
            t0 = time.perf_counter()
            lib.fill(ms, mask)
            t1 = time.perf_counter()
            ok = lib.accept(ms, [token] * BATCH)
            accept.append(time.perf_counter() - t1)
            fill.append(t1 - t0)
            assert all(ok), f"{c.name}: token {token} refused"
        assert all(lib.done(m) for m in ms), f"{c.name}: not ended after EOS"
    med = statistics.median
    return {
        "compile_ms": compile_s * 1e3,
        "first_ms": first_s * 1e3,
        "new_us": med(new) * 1e6,
        "fill_ms": med(fill) * 1e3,
        "accept_ms": med(accept) * 1e3,
        "steps": len(path),
    }


def compare(tok, c: Case) -> list[str]:
    """Differences between the two libraries' allowed sets at each step of the path."""
    x, g = Xgr(tok, False), Llg(tok, False)
    mx, mg = x.matcher(x.compile(c)), g.compile(c)
    words = -(-len(tok) // 32)
    notes = []
    for step, token in enumerate(path_of(tok, c)):
        a, b = (
            torch.full((1, words), -1, dtype=torch.int32),
            torch.full((1, words), -1, dtype=torch.int32),
        )
        mx.fill_next_token_bitmask(a, 0)
        g.lt.fill_next_token_bitmask(mg, b, 0)
        if g.error(mg):
            return notes + [f"step {step}: llguidance fails: {g.error(mg)}"]
        sa, sb = allowed(a[0], len(tok)), allowed(b[0], len(tok))
        if sa != sb:
            only_x = [x.info.decoded_vocab[t] for t in sorted(sa - sb)[:5]]
            only_g = [x.info.decoded_vocab[t] for t in sorted(sb - sa)[:5]]
            refused = []  # tokens xgrammar's mask allows and its own accept_token refuses
            for t in sorted(sa - sb):
                if mx.accept_token(t):
                    mx.rollback(1)
                else:
                    refused.append(x.info.decoded_vocab[t])
            bad = f" (refused by xgrammar's own accept_token: {refused})" if refused else ""
            notes.append(
                f"step {step}: {len(sa)} vs {len(sb)} allowed; only xgrammar "
                f"{len(sa - sb)} {only_x}, only llguidance {len(sb - sa)} {only_g}{bad}"
            )
        mx.accept_token(token)
        mg.consume_token(token)
    return notes


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizers", default="bench,default,bpe-32k,bpe-128k")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-steps", type=int, default=200, help="timed steps a variant a round")
    p.add_argument("--markdown", default=None, help="also write the tables here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from importlib.metadata import version

    lines = [
        f"xgrammar {version('xgrammar')}, llguidance {version('llguidance')}, "
        f"batch {BATCH}, {a.rounds} rounds, 1 thread"
    ]
    results: dict = {}
    for name in a.tokenizers.split(","):
        tok = load_tokenizer(name)
        cases = WORD_CASES if tok.backend_tokenizer.decoder is None else TEXT_CASES
        setup: dict[str, list[float]] = {v: [] for v in ("xgr-loop", "llg-loop")}
        runs: dict = {(v, c.name): [] for c in cases for v in VARIANTS}
        for _ in range(a.rounds):
            for v, make in VARIANTS.items():
                t0 = time.perf_counter()
                lib = make(tok)
                if v in setup:
                    setup[v].append((time.perf_counter() - t0) * 1e3)
                for c in cases:
                    runs[v, c.name].append(one_round(lib, tok, c, a.min_steps))
        med = {
            k: next((r for r in rs if isinstance(r, str)), None)
            or {f: statistics.median(r[f] for r in rs) for f in rs[0]}
            for k, rs in runs.items()
        }
        results[name] = {
            "setup_ms": {v: statistics.median(s) for v, s in setup.items()},
            "cases": {f"{v} {c}": m for (v, c), m in med.items()},
        }
        lines += [
            "",
            f"{name}: vocabulary {len(tok)}; vocabulary build: xgrammar "
            f"{results[name]['setup_ms']['xgr-loop']:.0f} ms, llguidance "
            f"{results[name]['setup_ms']['llg-loop']:.0f} ms",
            "",
            "| constraint (steps) | variant | compile ms | first mask ms | new matcher us | "
            f"fill {BATCH} ms/step | accept {BATCH} ms/step |",
            "|---|---|--:|--:|--:|--:|--:|",
        ]
        for c in cases:
            for v in VARIANTS:
                m = med[v, c.name]
                if isinstance(m, str):
                    lines.append(f"| {c.name} | {v} | fails: {m} | | | | |")
                    continue
                lines.append(
                    f"| {c.name} ({m['steps']:.0f}) | {v} | {m['compile_ms']:.2f} | "
                    f"{m['first_ms']:.2f} | {m['new_us']:.0f} | {m['fill_ms']:.3f} | "
                    f"{m['accept_ms']:.3f} |"
                )
        for c in cases:
            diff = compare(tok, c)
            results[name][f"diff {c.name}"] = diff
            shown = diff[:3] + [d for d in diff[3:] if "refused" in d]  # and every refusal
            more = f"; {len(diff) - len(shown)} more steps" if len(diff) > len(shown) else ""
            lines.append(
                f"- {c.name}: allowed sets "
                + (
                    "equal at every step"
                    if not diff
                    else f"differ at {len(diff)} steps: " + "; ".join(shown) + more
                )
            )
    print("\n".join(lines))
    if a.markdown:
        Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(a.markdown).write_text("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
