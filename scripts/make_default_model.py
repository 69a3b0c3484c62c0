"""Build batchgen's embedded default model and the sample datasets the demo jobs read.

    python scripts/make_default_model.py [--out batchgen/assets] [--train-seconds 180]

Writes
  <out>/default-model/   a tiny GPT-2 (transformers checkpoint, safetensors, float32) and its
                         byte-level BPE tokenizer, so `batchgen run` works with no --model and no hub
  <out>/samples/         reviews.parquet, topics.parquet, prompts.parquet

Everything is synthetic: reviews and topic texts come from templates and word lists, a BPE
tokenizer is trained on them, and the model learns the three demo-job formats

    Review: <text>\\nSentiment: positive<|endoftext|>
    Review: <text>\\nSummary: The reviewer liked the plot of the film.<|endoftext|>
    Text: <text>\\nTopic: sports<|endoftext|>

The sample rows are held out: none of their texts occurs in the training set. The run is
reproducible: seeds are fixed and training runs a fixed number of steps. --train-seconds is only a
safety cap; if it stops training early the result depends on the machine's speed, and the script
says so.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

SEED = 1234
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SENTIMENTS = ("positive", "negative", "neutral")
TOPICS = ("sports", "tech", "food", "travel")

# ---------------------------------------------------------------------------------------------
# Synthetic text. A review is one main sentence naming an item and an aspect with the review's
# polarity, then up to two more sentences of the same polarity and maybe a polarity-free filler.
# Its summary is built from the main sentence's parts, so the model can learn to copy them.

PRODUCTS = {
    "items": [
        "headphones",
        "blender",
        "laptop",
        "backpack",
        "coffee maker",
        "phone case",
        "desk lamp",
        "keyboard",
        "water bottle",
        "running shoes",
        "vacuum cleaner",
        "camera",
        "tent",
        "toaster",
        "smartwatch",
        "speaker",
        "mattress",
        "jacket",
        "kettle",
        "monitor",
    ],
    "aspects": [
        "battery life",
        "sound quality",
        "build quality",
        "price",
        "design",
        "screen",
        "fabric",
        "packaging",
        "setup",
        "customer service",
        "size",
        "weight",
        "instructions",
        "finish",
        "handle",
        "charger",
    ],
    "used": ["bought", "ordered", "got", "received"],
}
MOVIES = {
    "items": [
        "movie",
        "film",
        "documentary",
        "sequel",
        "thriller",
        "comedy",
        "cartoon",
        "drama",
        "horror film",
        "musical",
        "western",
        "series",
    ],
    "aspects": [
        "plot",
        "acting",
        "soundtrack",
        "ending",
        "dialogue",
        "pacing",
        "cast",
        "visuals",
        "script",
        "humour",
        "opening scene",
        "villain",
    ],
    "used": ["watched", "saw", "streamed", "rented"],
}
WHEN = [
    "last week",
    "in March",
    "for my birthday",
    "on a rainy weekend",
    "with my family",
    "a month ago",
    "after reading the reviews",
    "on a friend's advice",
    "yesterday",
    "in May",
]
ADJ = {
    "positive": [
        "great",
        "excellent",
        "wonderful",
        "fantastic",
        "superb",
        "brilliant",
        "lovely",
        "impressive",
        "solid",
        "delightful",
        "amazing",
        "perfect",
    ],
    "negative": [
        "terrible",
        "awful",
        "poor",
        "disappointing",
        "cheap",
        "boring",
        "broken",
        "flimsy",
        "dreadful",
        "useless",
        "horrible",
        "weak",
    ],
    "neutral": [
        "okay",
        "average",
        "ordinary",
        "acceptable",
        "fair",
        "unremarkable",
        "standard",
        "middling",
        "passable",
        "so-so",
        "adequate",
        "plain",
    ],
}
OPENER = {
    "positive": [
        "I love the",
        "I really enjoyed the",
        "I would recommend the",
        "So happy with the",
    ],
    "negative": ["I regret the", "I hated the", "I am annoyed with the", "So unhappy with the"],
    "neutral": [
        "I have no strong feelings about the",
        "I tried the",
        "Not much to say about the",
        "I have mixed thoughts on the",
    ],
}
CLOSING = {
    "positive": [
        "five stars",
        "highly recommended",
        "worth every penny",
        "I would do it again",
        "a real pleasure",
        "better than expected",
    ],
    "negative": [
        "one star",
        "avoid it",
        "a waste of money",
        "never again",
        "a big letdown",
        "worse than expected",
    ],
    "neutral": [
        "three stars",
        "nothing special",
        "it is what it is",
        "neither good nor bad",
        "about what I expected",
        "fine for the price",
    ],
}
INTENSIFIER = ["Really", "Truly", "Quite", "Very", "Honestly", "Simply"]
SUMMARY = {
    "positive": "The reviewer liked the {aspect} of the {item}.",
    "negative": "The reviewer disliked the {aspect} of the {item}.",
    "neutral": "The reviewer found the {aspect} of the {item} average.",
}
MAIN_TEMPLATES = [
    "The {aspect} of this {item} is {adj}.",
    "{opener} {item}, the {aspect} is {adj}.",
    "What {a_adj} {item}, the {aspect} is {adj2}.",
    "This {item} has {a_adj} {aspect}.",
    "{intens} {adj} {aspect} on this {item}.",
]
MORE_TEMPLATES = [
    "{Closing}.",
    "The {aspect2} is {adj}.",
    "{intens} {adj}, {closing}.",
    "Overall {adj}.",
]

TOPIC_WORDS = {
    "sports": {
        "team": [
            "Rovers",
            "City",
            "United",
            "the Tigers",
            "the Eagles",
            "the home side",
            "the visitors",
            "the Sharks",
        ],
        "event": [
            "league match",
            "cup final",
            "marathon",
            "tennis open",
            "relay race",
            "derby",
            "semi-final",
            "grand prix",
        ],
        "player": [
            "the striker",
            "the goalkeeper",
            "the captain",
            "a young winger",
            "the sprinter",
            "the champion",
        ],
    },
    "tech": {
        "gadget": [
            "phone",
            "tablet",
            "laptop",
            "smartwatch",
            "router",
            "graphics card",
            "e-reader",
            "headset",
        ],
        "part": ["processor", "battery", "camera", "chip", "display", "modem", "memory"],
        "software": [
            "browser",
            "operating system",
            "photo app",
            "compiler",
            "database",
            "messaging app",
            "game engine",
        ],
    },
    "food": {
        "dish": [
            "soup",
            "pasta",
            "curry",
            "bread",
            "cake",
            "risotto",
            "salad",
            "stew",
            "pie",
            "omelette",
        ],
        "ingredient": [
            "garlic",
            "butter",
            "lemon",
            "basil",
            "rice",
            "cheese",
            "onion",
            "honey",
            "ginger",
            "tomato",
        ],
        "cook": ["bake", "simmer", "roast", "fry", "grill", "stir"],
    },
    "travel": {
        "place": [
            "Lisbon",
            "Kyoto",
            "the coast",
            "the mountains",
            "Rome",
            "the islands",
            "Oslo",
            "the desert",
            "Vienna",
            "a small village",
        ],
        "transport": ["train", "ferry", "bus", "flight", "night train", "rental car"],
        "sight": [
            "old harbour",
            "castle",
            "beaches",
            "markets",
            "museums",
            "cathedral",
            "hiking trails",
            "hot springs",
        ],
    },
}
TOPIC_TEMPLATES = {
    "sports": [
        "{team} won the {event} in the last minute.",
        "{Player} scored twice in the {event}.",
        "Fans cheered as {team} lifted the trophy after the {event}.",
        "The {event} was delayed by rain, then {team} took the lead.",
        "{Player} was injured before the {event}.",
    ],
    "tech": [
        "The new {gadget} ships with a faster {part}.",
        "An update to the {software} fixes a bug in the {part} driver.",
        "The company announced a {gadget} with a bigger {part}.",
        "Users say the {software} crashes on the old {gadget}.",
        "Engineers rewrote the {software} to save {part} power.",
    ],
    "food": [
        "This {dish} needs {ingredient} and a little {ingredient2}.",
        "{Cook} the {dish} for {n} minutes with {ingredient}.",
        "The chef served {dish} with fresh {ingredient}.",
        "Add {ingredient} to the {dish} before you {cook} it.",
        "My grandmother's {dish} recipe uses {ingredient2}.",
    ],
    "travel": [
        "We took the {transport} to {place} and stayed {n} nights.",
        "The {transport} to {place} was delayed by {n} hours.",
        "{Place} is famous for its {sight}.",
        "Book the {transport} early if you visit {place} in summer.",
        "From {place} we walked to the {sight}.",
    ],
}


@dataclass(frozen=True, slots=True)
class Review:
    text: str
    label: str
    summary: str


@dataclass(frozen=True, slots=True)
class Topic:
    text: str
    label: str


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _a(word: str) -> str:
    vowel_sound = word[0] in "aeio" or word.startswith("un")  # "an unremarkable", "a useless"
    return f"{'an' if vowel_sound else 'a'} {word}"


def make_review(rng: random.Random, label: str, extra: int | None = None) -> Review:
    kind = PRODUCTS if rng.random() < 0.6 else MOVIES
    item, aspect = rng.choice(kind["items"]), rng.choice(kind["aspects"])
    adj, adj2 = rng.sample(ADJ[label], 2)
    main = rng.choice(MAIN_TEMPLATES).format(
        item=item,
        aspect=aspect,
        adj=adj,
        adj2=adj2,
        a_adj=_a(adj),
        opener=rng.choice(OPENER[label]),
        intens=rng.choice(INTENSIFIER),
    )
    sentences = [_cap(main)]
    for _ in range(rng.choice((0, 0, 1, 1, 2)) if extra is None else extra):
        closing = rng.choice(CLOSING[label])
        sentences.append(
            rng.choice(MORE_TEMPLATES).format(
                aspect2=rng.choice(kind["aspects"]),
                adj=rng.choice(ADJ[label]),
                intens=rng.choice(INTENSIFIER),
                closing=closing,
                Closing=_cap(closing),
            )
        )
    if rng.random() < 0.3:  # a polarity-free filler must not change the label
        sentences.insert(
            rng.randrange(1, len(sentences) + 1),
            f"I {rng.choice(kind['used'])} it {rng.choice(WHEN)}.",
        )
    return Review(" ".join(sentences), label, SUMMARY[label].format(aspect=aspect, item=item))


def make_topic(rng: random.Random, label: str) -> Topic:
    words = TOPIC_WORDS[label]
    fields = {k: rng.choice(v) for k, v in words.items()}
    fields.update({_cap(k): _cap(v) for k, v in fields.items()})
    if label == "food":
        fields["ingredient2"] = rng.choice(words["ingredient"])
    fields["n"] = rng.randint(2, 12)
    n_sentences = rng.choice((1, 1, 2))
    texts = [rng.choice(TOPIC_TEMPLATES[label]).format(**fields) for _ in range(n_sentences)]
    return Topic(" ".join(dict.fromkeys(texts)), label)  # dict: drop a repeated sentence


# Prompt formats, shared by training and the samples so the demo jobs match what the model saw.
def sentiment_prompt(text: str) -> str:
    return f"Review: {text}\nSentiment:"


def summary_prompt(text: str) -> str:
    return f"Review: {text}\nSummary:"


def topic_prompt(text: str) -> str:
    return f"Text: {text}\nTopic:"


def training_texts(rng: random.Random, n: int) -> tuple[list[str], set[str]]:
    """n formatted training documents (without EOS) and the set of raw texts they use."""
    docs, seen = [], set()
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            rev = make_review(rng, rng.choice(SENTIMENTS))
            docs.append(f"{sentiment_prompt(rev.text)} {rev.label}")
            seen.add(rev.text)
        elif r < 0.7:
            rev = make_review(rng, rng.choice(SENTIMENTS))
            docs.append(f"{summary_prompt(rev.text)} {rev.summary}")
            seen.add(rev.text)
        else:
            top = make_topic(rng, rng.choice(TOPICS))
            docs.append(f"{topic_prompt(top.text)} {top.label}")
            seen.add(top.text)
    return docs, seen


def held_out(rng: random.Random, n: int, labels, make, exclude: set[str]) -> list:
    """n rows with labels cycling through `labels`, none whose text is in `exclude` or repeated."""
    rows, taken = [], set(exclude)
    while len(rows) < n:
        row = make(rng, labels[len(rows) % len(labels)])
        if row.text not in taken:
            taken.add(row.text)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE like GPT-2's, with <|endoftext|> as bos, eos and pad.


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chat_words = ["system: user: assistant: You are a helpful assistant."]
    tok.train_from_iterator(docs + chat_words, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, model_max_length=512
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---------------------------------------------------------------------------------------------
# Model and training.


def build_model(vocab_size: int, eos_id: int) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=512,
        n_embd=128,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(config)


def batches(token_ids: list[list[int]], batch_size: int, pad_id: int, rng: random.Random):
    """Endless shuffled batches, right-padded; loss is masked on padding (pad == eos, so the mask
    comes from the lengths, keeping each document's real final eos as a target)."""
    order = list(range(len(token_ids)))
    while True:
        rng.shuffle(order)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            seqs = [token_ids[j] for j in order[i : i + batch_size]]
            width = max(map(len, seqs))
            ids = torch.full((batch_size, width), pad_id, dtype=torch.long)  # (B, T)
            mask = torch.zeros((batch_size, width), dtype=torch.long)
            for b, s in enumerate(seqs):
                ids[b, : len(s)] = torch.tensor(s)
                mask[b, : len(s)] = 1
            yield ids, mask, ids.masked_fill(mask == 0, -100)


def train(model, token_ids, args, rng: random.Random) -> tuple[float, int, float]:
    """AdamW with linear warmup and cosine decay over args.steps. Returns (loss, steps, seconds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    stream = batches(token_ids, args.batch_size, model.config.pad_token_id, rng)
    start, smooth, step = time.monotonic(), None, 0
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1)
        ids, mask, labels = next(stream)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        elapsed = time.monotonic() - start
        if step % 50 == 0 or step == args.steps:
            print(f"step {step:5d}  loss {loss.item():.4f}  (ema {smooth:.4f})  {elapsed:6.1f}s")
        if elapsed > args.train_seconds and step < args.steps:
            print(
                f"WARNING: --train-seconds {args.train_seconds} reached at step {step} of "
                f"{args.steps}; this checkpoint depends on machine speed (not reproducible)."
            )
            break
    model.eval()
    return smooth, step, time.monotonic() - start


@torch.no_grad()
def greedy(model, tok, prompt: str, max_new_tokens: int) -> str:
    enc = tok(prompt, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def label_accuracy(model, tok, rows, prompt_fn) -> float:
    hits = sum(greedy(model, tok, prompt_fn(r.text), 3).split()[:1] == [r.label] for r in rows)
    return hits / len(rows)


def summary_accuracy(model, tok, reviews: list[Review]) -> float:
    hits = sum(greedy(model, tok, summary_prompt(r.text), 20).strip() == r.summary for r in reviews)
    return hits / len(reviews)


# ---------------------------------------------------------------------------------------------
# Samples.


def prompt_rows(rng: random.Random, tok, n: int, exclude: set[str]) -> list[str]:
    """n free prompts whose token lengths spread evenly over 5..200, so length bucketing matters.
    Each body is a long held-out text cut to the most words that keep the prompt within its target."""
    formats = [sentiment_prompt, summary_prompt, topic_prompt]
    prompts = []
    for i in range(n):
        target = round(5 + (200 - 5) * i / (n - 1))
        fmt = formats[i % len(formats)]
        parts = []
        while len(" ".join(parts).split()) < 220:
            if fmt is topic_prompt:
                parts.append(make_topic(rng, rng.choice(TOPICS)).text)
            else:
                parts.append(make_review(rng, rng.choice(SENTIMENTS), extra=2).text)
        words = " ".join(parts).split()
        lo, hi = 1, len(words)  # largest word count whose prompt fits in `target` tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tok(fmt(" ".join(words[:mid])))["input_ids"]) <= target:
                lo = mid
            else:
                hi = mid - 1
        body = " ".join(words[:lo])
        assert body not in exclude
        prompts.append(fmt(body))
    order = list(range(n))
    rng.shuffle(order)  # mixed lengths in file order, as a real job would see them
    return [prompts[j] for j in order]


def ids(prefix: str, rows: list) -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(1, len(rows) + 1)]  # r0001, r0002, ...


def write_parquet(path: Path, columns: dict[str, list]) -> None:
    pq.write_table(pa.table(columns), path, compression="zstd")


# ---------------------------------------------------------------------------------------------


def verify(model_dir: Path, tok: PreTrainedTokenizerFast, probes: list[str]) -> None:
    loaded = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert loaded.is_fast, type(loaded)
    for text in probes:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"], text
        assert loaded.decode(loaded(text)["input_ids"]) == text, text
    assert loaded.eos_token == loaded.bos_token == loaded.pad_token == EOS
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    print(
        f"verified: AutoTokenizer -> {type(loaded).__name__}, "
        f"AutoModelForCausalLM -> {type(model).__name__}"
    )


def write_model(model_dir: Path, model, tok, acc: dict, steps: int) -> None:
    shutil.rmtree(model_dir, ignore_errors=True)  # no stale files from an older layout
    model_dir.mkdir(parents=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=32,
        do_sample=False,
    )
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    for path in model_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; these files ship in the package
    n_params = sum(p.numel() for p in model.parameters())
    (model_dir / "README.md").write_text(
        f"""# batchgen default model

A tiny GPT-2 ({n_params:,} parameters: 4 layers, width 128, 4 heads, 512 positions, byte-level BPE
vocabulary of {len(tok)} tokens with `<|endoftext|>` as bos/eos/pad) trained from scratch by
`scripts/make_default_model.py` on synthetic, template-generated text. It is a demo, not a useful
language model: it exists so that `batchgen run` works with no `--model` and no model hub.

It has seen only three formats (the ones the demo jobs and `../samples/` use):

    Review: <text>\\nSentiment:   -> positive | negative | neutral
    Review: <text>\\nSummary:     -> The reviewer liked the <aspect> of the <item>.
    Text: <text>\\nTopic:         -> sports | tech | food | travel

Trained {steps} steps; greedy label accuracy on the held-out sample rows: sentiment
{acc["sentiment"]:.1%}, topic {acc["topic"]:.1%}; summaries exactly right on {acc["summary"]:.0%}
of the first 50 sample reviews. Anything else it generates is noise.
The tokenizer has a minimal chat template (`role: content` lines, then `assistant:` when
`add_generation_prompt=True`).

Rebuild (deterministic): `python scripts/make_default_model.py`
"""
    )


def write_samples(sample_dir: Path, reviews: list[Review], topics: list[Topic], prompts) -> None:
    sample_dir.mkdir(parents=True, exist_ok=True)
    write_parquet(
        sample_dir / "reviews.parquet",
        {
            "id": ids("r", reviews),
            "text": [r.text for r in reviews],
            "label": [r.label for r in reviews],
            "summary": [r.summary for r in reviews],
        },
    )
    write_parquet(
        sample_dir / "topics.parquet",
        {
            "id": ids("t", topics),
            "text": [t.text for t in topics],
            "label": [t.label for t in topics],
        },
    )
    write_parquet(sample_dir / "prompts.parquet", {"id": ids("p", prompts), "prompt": prompts})
    (sample_dir / "README.md").write_text(
        f"""# batchgen sample datasets

Synthetic, held-out rows (no text here occurs in the default model's training set), written by
`scripts/make_default_model.py`. All columns are strings.

| file | rows | columns |
|---|---|---|
| `reviews.parquet` | {len(reviews)} | `id` (r0001..), `text`, `label` (positive/negative/neutral), `summary` (reference) |
| `topics.parquet` | {len(topics)} | `id` (t0001..), `text`, `label` (sports/tech/food/travel) |
| `prompts.parquet` | {len(prompts)} | `id` (p0001..), `prompt`: ready-made prompts in the three formats, 5..200 tokens long, in shuffled length order |

Prompts for the first two files: `Review: {{text}}\\nSentiment:`, `Review: {{text}}\\nSummary:`,
`Text: {{text}}\\nTopic:`.
"""
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("batchgen/assets"))
    p.add_argument("--train-seconds", type=float, default=180.0, help="safety cap on training")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--train-docs", type=int, default=20000)
    p.add_argument("--vocab-size", type=int, default=2000)
    p.add_argument("--seed", type=int, default=SEED)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    # Separate streams, so that e.g. a shorter training run leaves the data and samples unchanged.
    data_rng, sample_rng, train_rng = (random.Random(args.seed + k) for k in range(3))

    docs, seen = training_texts(data_rng, args.train_docs)
    reviews = held_out(sample_rng, 200, SENTIMENTS, make_review, seen)
    topics = held_out(sample_rng, 100, TOPICS, make_topic, seen)
    tok = train_tokenizer(docs, args.vocab_size)
    prompts = prompt_rows(sample_rng, tok, 64, seen)
    token_ids = [ids + [tok.eos_token_id] for ids in tok(docs)["input_ids"]]
    print(
        f"corpus: {len(docs)} training docs, {len(seen)} distinct texts, mean "
        f"{sum(map(len, token_ids)) / len(token_ids):.1f} tokens; tokenizer vocab {len(tok)}; "
        f"held out {len(reviews)} reviews, {len(topics)} topics, {len(prompts)} prompts"
    )

    model = build_model(len(tok), tok.eos_token_id)
    print(f"model: GPT-2, {sum(p.numel() for p in model.parameters()):,} parameters")
    loss, steps, seconds = train(model, token_ids, args, train_rng)
    acc = {
        "sentiment": label_accuracy(model, tok, reviews, sentiment_prompt),
        "topic": label_accuracy(model, tok, topics, topic_prompt),
        "summary": summary_accuracy(model, tok, reviews[:50]),
    }
    print(
        f"trained {steps} steps in {seconds:.1f}s, final loss (ema) {loss:.4f}; held-out "
        f"accuracy: sentiment {acc['sentiment']:.1%}, topic {acc['topic']:.1%}, "
        f"summary exact match {acc['summary']:.1%} (first 50 reviews)"
    )

    model_dir, sample_dir = args.out / "default-model", args.out / "samples"
    write_model(model_dir, model, tok, acc, steps)
    write_samples(sample_dir, reviews, topics, prompts)
    verify(model_dir, tok, [docs[0], reviews[0].text, prompts[0], "héllo wörld 123 <|endoftext|>"])
    for path in sorted(model_dir.iterdir()) + sorted(sample_dir.iterdir()):
        print(f"{path.stat().st_size:>10,}  {path}")


if __name__ == "__main__":
    main()
