"""Plain-data types that flow through the engine: no torch here. A `Request` (prompt ids +
`DecodeParams`) comes in; the scheduler wraps it in a `SeqState`, its running state (tokens so
far, cache blocks, lifecycle), and plans each step as a `StepPlan` of `Scheduled` chunks; a
`Completion` goes out, and each step's accounting as a `StepReport`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# DecodeParams and Constraint live in engine/params.py; imported from here too, as before
from batchgen.engine.params import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS
from batchgen.engine.params import Constraint as Constraint
from batchgen.engine.params import ConstraintKind as ConstraintKind
from batchgen.engine.params import DecodeParams as DecodeParams
from batchgen.engine.params import SamplingParams as SamplingParams

TopLogprobs = list[tuple[int, float]]  # a position's likeliest (token id, logprob), best first


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens reached
    ERROR = "error"  # the row could not be run (see Completion.error)

    def __str__(self) -> str:  # "stop", as vLLM's finish_reason prints (a str there)
        return self.value


@dataclass(slots=True)
class Request:
    """One prompt to run: already tokenized.

    With `candidates` (the score task) nothing is generated: the engine scores each candidate
    continuation (its log-probability given the prompt) as its own sequence, `prompt +
    candidate` with `score_from = len(prompt)`, the prompt's blocks computed once and shared
    through the prefix cache. A pooled row (`params.pooling`) has score_from = its length."""

    index: int  # position in the caller's list; results come back keyed by it
    prompt_ids: list[int]
    params: DecodeParams = field(default_factory=DecodeParams)
    candidates: tuple[tuple[int, ...], ...] = ()  # continuations to score instead of generating
    score_from: int | None = None  # a candidate's sequence: tokens from here are scored
    cache_salt: int | None = None  # parent of its first cache key (longrope rows: engine.py)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def scoring(self) -> bool:
        """Does it only score (a candidate, or a prompt-logprobs row): nothing sampled."""
        return self.score_from is not None

    @property
    def scored(self) -> range | None:
        """The tokens whose log-probabilities the engine hands back (None: none): a
        candidate's, or with `params.prompt_logprobs` the prompt's from its second token (the
        first has no context); a row that also generates scores its prompt only."""
        if self.score_from is None and self.params.prompt_logprobs is None:
            return None
        start = 1 if self.score_from is None else self.score_from
        return range(start, self.prompt_len)

    @property
    def max_tokens(self) -> int:
        """Cache slots the request may need: prompt and generated tokens."""
        return self.prompt_len + (0 if self.scoring else self.params.max_new_tokens)

    @property
    def longest_tokens(self) -> int:
        """Cache slots its longest sequence needs: max_tokens, or with candidates the prompt
        and its longest candidate."""
        if self.candidates:
            return self.prompt_len + max(map(len, self.candidates))
        return self.max_tokens


@dataclass(slots=True)
class Completion:
    index: int
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    text: str = ""
    error: str | None = None
    logprobs: list[float] | None = None  # of each generated token
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    scores: list[float] | None = None  # score task: log P(candidate | prompt), per candidate
    # time.perf_counter() stamps at step boundaries (0.0: never, e.g. a row refused at once)
    queued_at: float = 0.0  # the request entered the engine's queue
    first_token_at: float = 0.0  # the step that sampled its first token ended
    finished_at: float = 0.0  # the step that finished it ended
    top_logprobs: list[TopLogprobs] | None = None  # per generated token, where asked for
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # params.prompt_logprobs: each prompt token's logprob (the first's None, as in vLLM) and,
    # where asked for, its position's likeliest alternatives (the first's empty)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None
    pooled: list[float] | None = None  # params.pooling: the prompt pooled (or its head's logits)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its cache blocks given back)
    RUNNING = "running"  # holds cache blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class SeqState:
    """A request in flight: its tokens (prompt, then generated), how many of them have
    their keys/values in the cache, and the cache blocks that hold them."""

    request: Request
    arrival: int  # order of arrival, for tie-breaks
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each generated (or scored) token
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # where params ask for them
    prompt_logprobs: list[float] = field(default_factory=list)  # params.prompt_logprobs: from 1
    prompt_top: list[TopLogprobs] = field(default_factory=list)  # and their alternatives
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of its full blocks
    num_registered: int = 0  # leading blocks of block_table already in the prefix cache
    num_cached_prompt: int = 0  # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    keep: int | None = None  # generated tokens kept when a stop string cut the output
    error: str | None = None  # why it ended with FinishReason.ERROR
    queued_at: float = 0.0  # perf_counter when it entered the queue
    first_token_at: float = 0.0  # perf_counter at the end of the step sampling its first token
    eos_ids: frozenset[int] = frozenset()  # the model's (the scheduler's), ignore_eos or not
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # the request's, kept: read for every row of every step
    prompt_len: int = field(init=False, default=0)
    params: DecodeParams = field(init=False, default=None)
    pooled: object = None  # a pooled row: the runner's running state, then its vector (a list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_ids)
        self.prompt_len = self.request.prompt_len
        self.params = self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end it: EOS (unless ignore_eos) and its stop_token_ids."""
        eos = frozenset() if self.params.ignore_eos else self.eos_ids
        return eos | frozenset(self.params.stop_token_ids)

    def hittable_blocks(self, block_size: int) -> int:
        """Leading full blocks a prefix-cache hit may cover: at least its last token must run
        (to sample from), and where it scores tokens the one before its first (whose logits
        score it): none for a prompt-logprobs row (scored from its second token) or a row
        pooling every token's hidden state (engine/pooling.py)."""
        last = self.num_tokens - 1
        if self.request.scored is not None:
            last = min(last, self.request.scored.start - 1)
        pooling = self.params.pooling
        return 0 if pooling is not None and pooling.every_token else last // block_size

    def take_scored(self, chunk: ScoredChunk) -> None:
        """A step's scored tokens of it: a candidate's logprobs, or its prompt's."""
        if self.params.prompt_logprobs is None:
            self.logprobs.extend(chunk.logprobs)
        else:
            self.prompt_logprobs.extend(chunk.logprobs)
            self.prompt_top.extend(chunk.top or ())

    def forget_scored(self) -> None:
        """Preempted: its scored tokens run again."""
        if self.request.scoring:
            self.logprobs = []
        self.prompt_logprobs, self.prompt_top, self.pooled = [], [], None

    @property
    def below_min_tokens(self) -> bool:
        """Has it generated fewer than min_tokens (its stop tokens are not drawn yet)?"""
        return self.num_generated < self.params.min_tokens


@dataclass(slots=True)
class ScoredChunk:
    """A step's scored tokens of one chunk (`Request.scored`): each one's log-probability and,
    for a prompt-logprobs row that asks, its position's likeliest alternatives."""

    logprobs: list[float]
    top: list[TopLogprobs] | None = None

    def __len__(self) -> int:
        return len(self.logprobs)


@dataclass(slots=True)
class Scheduled:
    """`num_tokens` tokens of `seq`, from position `start`, run this step."""

    seq: SeqState
    start: int
    num_tokens: int
    samples: bool  # the step computes the sequence's last token: a new token is sampled


@dataclass(slots=True)
class StepPlan:
    decodes: list[Scheduled] = field(default_factory=list)  # one sampled token each
    prefills: list[Scheduled] = field(default_factory=list)  # chunks of prompts
    preempted: list[SeqState] = field(default_factory=list)
    admitted: list[SeqState] = field(default_factory=list)  # first admissions (not recomputes)
    cache_lookups: int = 0  # full blocks the admissions looked up in the prefix cache
    cache_hits: int = 0  # of which found there

    @property
    def scheduled(self) -> list[Scheduled]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_tokens for s in self.prefills)

    @property
    def num_sampled(self) -> int:
        return len(self.decodes) + sum(s.samples for s in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills)


@dataclass(slots=True)
class StepReport:
    """One engine step: what finished and what it cost."""

    finished: list[Completion] = field(default_factory=list)
    prompt_tokens: int = 0  # prompt (and recomputed) tokens run this step
    cached_tokens: int = 0  # prompt tokens found in the prefix cache by new admissions
    decode_rows: int = 0  # sequences that decoded one token
    padded_rows: int = 0  # tokens computed only to fill a compiled shape (CUDA graphs)
    preempted: int = 0
    seconds: float = 0.0  # model time, compile excluded
    compile_seconds: float = 0.0  # the warm-up's compile (or a compile after it)
    capture_seconds: float = 0.0  # the warm-up's runs of every capture size (CUDA graphs)
    warmup_seconds: float = 0.0  # the warm-up's full-size eager steps (step_inputs.warmup_eager)
    compile_cache: str | None = None  # the warm-up's: "hit" or "miss" (None: no cache)
    graphs_compiled: int = 0  # the warm-up's: graphs inductor compiled (torch's counters)
    graphs_loaded: int = 0  # the warm-up's: graphs loaded from inductor's cache instead
    compiled: bool = False  # the step's forward ran the compiled graph
    prefill: bool = False  # the step ran prompt tokens (else decode only)
    cache_lookups: int = 0  # full prompt blocks looked up in the prefix cache by admissions
    cache_hits: int = 0  # of which found
    new_shape: bool = False  # the step ran a compiled shape for the first time
    collective_seconds: float = 0.0  # of seconds, in tensor-parallel collectives (where timed)
    host_gap_seconds: float | None = None  # the host's time since the last step (None: first)
    # for the step timeline and the roofline (engine/step_cost.py)
    at: float = 0.0  # time.perf_counter() when the step ended
    logits_rows: int = 0  # positions that went through the LM head (sampled or scored)
    sampled: int = 0  # tokens sampled (decodes and prompts' first tokens)
    context_tokens: int = 0  # sum over computed tokens of the keys each attended to
    waiting: int = 0  # sequences waiting (not admitted, or preempted) after the step
    kv_blocks_used: int = 0  # blocks held by sequences after the step
    kv_blocks_free: int = 0  # blocks free (cached prefixes that may be evicted included)


@dataclass(slots=True, frozen=True)
class KVPool:
    """The paged KV cache as allocated: blocks (the scratch block included) of block_size
    token slots, and their bytes on the device."""

    num_blocks: int
    block_size: int
    bytes: int

    @property
    def tokens(self) -> int:
        """Token slots sequences can hold (the scratch block is not theirs)."""
        return (self.num_blocks - 1) * self.block_size
