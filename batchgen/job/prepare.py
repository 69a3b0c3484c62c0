"""Input rows -> engine requests: render prompts, tokenize, apply per-row options
(row_options.py).

Works one window of rows at a time, so a 10-million-row input is never held at once, nor its
ids: they were checked unique when the job opened, before the model loaded (job/ids.py
`check_unique_ids`, one pass over the id column in Arrow; an OpenAI batch file's custom_ids
as it is parsed). A set of every id seen here caught nothing those checks had not, and held
66-119 MB a million rows (int and uuid ids) for the whole run.
Rows that cannot run become error records here, before the engine sees them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from batchgen.choices import BOUNDS
from batchgen.data import InputFormat, InputSource, PromptBuilder, default_ids
from batchgen.data.records import RecordShape, Row
from batchgen.data.source import DEFAULT_ID_COLUMN, decode_rows
from batchgen.engine.sequence import Request
from batchgen.errors import InputError, RowError
from batchgen.job.bias_column import compact_bias_column, compact_field
from batchgen.job.config import RunConfig
from batchgen.job.embedding import PooledTask, line_error
from batchgen.job.ids import check_id_type
from batchgen.job.passthrough import passthrough_columns
from batchgen.job.prompt_builders import make_prompt_builder, openai_prompt_builders
from batchgen.job.row_options import RowOptions, row_number, warn_option_columns
from batchgen.job.tokenization import fit_length, tokenize_prompts, warn_cut


@dataclass(slots=True)
class Window:
    """One window of rows: `rows[r.index]` is the row of request r."""

    rows: list[Row]
    requests: list[Request]
    skipped: int = 0  # output records of its input rows not produced here (done, other shards)

    @property
    def errors(self) -> list[Row]:
        return [r for r in self.rows if r.error is not None]


class Preparer:
    def __init__(
        self,
        cfg: RunConfig,
        source: InputSource,
        tokenizer,
        max_prompt_len: int,
        limit_name: str = "--max-prompt-len",  # what max_prompt_len comes from, for errors
        pooled: PooledTask | None = None,  # task embed / classify (job/embedding.py)
    ) -> None:
        self.cfg, self.source, self.tokenizer = cfg, source, tokenizer
        self.pooled = pooled
        self.chat_builder: PromptBuilder | None = None  # chat rows of an OpenAI batch file
        if source.format is InputFormat.OPENAI:
            self.builder, self.chat_builder = openai_prompt_builders(cfg, tokenizer)
        else:
            self.builder = make_prompt_builder(cfg, tokenizer)
        self.id_column = cfg.id_column or source.id_column  # None: row numbers
        self.max_prompt_len, self.limit_name = max_prompt_len, limit_name
        self.passthrough = passthrough_columns(cfg, source, self.id_column)  # input: output
        self.options = RowOptions(cfg, source.columns, tokenizer)
        if source.format is not InputFormat.OPENAI:  # there the parser made them, from bodies
            warn_option_columns(source.columns)
        self.score = self.options.score
        # n samples per row (--n or an n column): one output record per (id, sample_index)
        self.n_column = "n" in source.columns
        self.samples = cfg.n > 1 or self.n_column
        self.as_list = cfg.n_as_list  # one record per row, its samples gathered (--n-as-list)
        needed = self.builder.required_columns() | set(self.passthrough) | self.options.columns
        needed |= {"n"} if self.n_column else set()
        if self.chat_builder is not None:
            needed |= self.chat_builder.required_columns() | {"embeddings", "dimensions"}
        needed |= {c for c in (self.id_column, source.error_column) if c}
        source.require_columns(sorted(needed), self.builder.missing_fixes(source.columns))
        if self.id_column:
            check_id_type(source, self.id_column)
        self.columns = [c for c in source.columns if c in needed]
        if source.error_column and source.error_column not in self.columns:
            self.columns.append(source.error_column)  # JSON Lines': added to the batches read
        self._warned_cut = False  # once a job: --truncate left a prompt only a sliver

    @property
    def output_id_column(self) -> str:
        """The output's id column: the input's id column under its own name, else `id`."""
        return self.id_column or DEFAULT_ID_COLUMN

    @property
    def records_per_row(self) -> int:
        """Output records a row gives: --n (an n column's rows: approximate), one with
        --n-as-list."""
        return 1 if self.as_list else self.cfg.n

    @property
    def record_shape(self) -> RecordShape:
        return RecordShape(
            id_column=self.output_id_column,
            score=self.score,
            prompt_logprobs=self.options.defaults.prompt_logprobs,  # task prompt-logprobs: k
            pooled=self.pooled.columns if self.pooled else None,
            samples=self.samples,
            as_list=self.as_list,
            with_token_ids=self.cfg.with_token_ids,
            with_logprobs=self.cfg.with_logprobs,
            with_stop_reason=self.cfg.with_stop_reason,
            with_timings=self.cfg.with_timings,
            with_top_logprobs="top_logprobs" in self.source.columns,
        )

    def output_schema(self) -> pa.Schema:
        """The output's schema: the record shape over the id's type and the passthrough."""
        fields = self.source.schema
        passthrough = pa.schema(
            [compact_field(fields.field(c)).with_name(n) for c, n in self.passthrough.items()]
        )
        return self.record_shape.schema(self.id_type, passthrough)

    @property
    def id_type(self):
        return self.source.schema.field(self.id_column).type if self.id_column else pa.int64()

    def windows(self, done: set[Any]) -> Iterator[tuple[int, Window]]:
        """Yield (rows read, window of rows not done yet) until the input (or limit) ends."""
        limit = self.cfg.limit
        read = 0
        for offset, batch in self.source.iter_batches(self.cfg.window_rows, columns=self.columns):
            if limit is not None and read >= limit:
                return
            if limit is not None and read + batch.num_rows > limit:
                batch = batch.slice(0, limit - read)
            read += batch.num_rows
            n_read = batch.num_rows
            row_numbers = list(range(offset, offset + batch.num_rows))
            if self.id_column:
                ids, bad = decode_rows(batch.select([self.id_column]), row_numbers)
                if bad:
                    raise InputError(f"id column {self.id_column!r}: {next(iter(bad.values()))}")
                ids = [r[self.id_column] for r in ids]
            else:
                ids = default_ids(offset, batch.num_rows).to_pylist()
            other = 0
            if self.cfg.shard is not None:  # other shards' rows are neither rendered nor checked
                keep = self.cfg.shard.mask(ids)
                other = len(keep) - sum(keep)
                batch = batch.filter(pa.array(keep, pa.bool_()))
                ids = list(itertools.compress(ids, keep))
                row_numbers = list(itertools.compress(row_numbers, keep))
            records, bad = decode_rows(compact_bias_column(batch), row_numbers)
            window = self._window(records, ids, done, bad)
            window.skipped += other * self.records_per_row
            yield n_read, window

    def _window(
        self, records: list[dict], ids: list[Any], done: set[Any], bad: dict[int, str]
    ) -> Window:
        """bad: {position: error} of rows that could not be decoded (see decode_rows). Each row
        gives one output record per sample not done yet (one, without n)."""
        rows: list[Row] = []
        texts: list[str] = []
        chats: list[bool] = []  # per text: rendered by a chat template
        pending: list[tuple[int, dict, list[int]]] = []  # (first row, record, samples) rendered
        skipped = 0
        error_column = self.source.error_column
        for i, (rec, rid) in enumerate(zip(records, ids, strict=True)):
            self._check_id(rid)
            n, n_error = self._num_samples(rec)
            todo = [k for k in range(n) if self._key(rid, k) not in done]
            skipped += (not todo) if self.as_list else n - len(todo)  # records
            if not todo:
                continue
            first = len(rows)
            passthrough = {n: rec[c] for c, n in self.passthrough.items()}
            for k in todo:
                sample = k if self.samples or self.as_list else None
                rows.append(Row(rid, passthrough, sample_index=sample, num_samples=n))
            error = bad.get(i) or n_error
            if error is None and error_column and rec[error_column] is not None:
                error = rec[error_column]
            if error is None and self.chat_builder is not None:  # an OpenAI line: its endpoint
                error = line_error(rec, self.pooled)
            if error is None:
                if self.chat_builder is not None and rec["messages"] is not None:
                    builder, chat = self.chat_builder, True
                else:
                    builder, chat = self.builder, bool(self.cfg.messages_column)
                try:
                    prefix = self.pooled.prefix if self.pooled else ""  # an instruction
                    texts.append(prefix + builder.render(rec))
                    chats.append(chat)
                    pending.append((first, rec, todo))
                except RowError as e:
                    error = e.message
            for row in rows[first:] if error is not None else ():
                row.error = error
        token_lists = self._tokenize(texts, chats)
        requests: list[Request] = []
        pairs = zip(pending, texts, token_lists, strict=True)
        for (first, rec, todo), text, (ids_, cut) in pairs:
            samples = rows[first : first + len(todo)]
            tail = text[-1:]  # a choice label's word boundary (row_options.py)
            try:
                fitted = fit_length(
                    ids_, self.max_prompt_len, self.cfg.truncate, cut, self.limit_name
                )
                if not self._warned_cut:
                    self._warned_cut = warn_cut(fitted, len(ids_), self.cfg.truncate)
                ids_ = fitted
                params = [self.options.params(rec, samples[0].id, k, tail) for k in todo]
            except RowError as e:
                for row in samples:
                    row.error = e.message
                continue
            if self.score:
                try:
                    labels, cands = self.options.labels(rec, tail)
                except RowError as e:
                    samples[0].error = e.message
                    continue
                samples[0].prompt_tokens, samples[0].labels = len(ids_), labels
                requests.append(Request(first, ids_, params[0], candidates=cands))
                continue
            if self.pooled is not None:  # its prompt pooled: nothing scored, nothing sampled
                samples[0].prompt_tokens = len(ids_)
                pooled = replace(params[0], pooling=self.pooled.pooling)
                requests.append(Request(first, ids_, pooled, score_from=len(ids_)))
                continue
            if params[0].prompt_logprobs is not None:  # the prompt scored from its 2nd token
                samples[0].prompt_tokens = len(ids_)
                requests.append(Request(first, ids_, params[0], score_from=1))
                continue
            for j, p in enumerate(params):  # the samples share the prompt's cache blocks
                samples[j].prompt_tokens = len(ids_)
                requests.append(Request(first + j, ids_, p))
        return Window(rows, requests, skipped)

    def _key(self, rid: Any, k: int) -> Any:
        """A record's key in the output: its id, or (id, sample_index) with a record per
        sample."""
        return (rid, k) if self.samples and not self.as_list else rid

    def _num_samples(self, rec: dict) -> tuple[int, str | None]:
        """(the row's n, an error message if its n column is bad: then 1)."""
        if not self.n_column or rec.get("n") is None:
            return self.cfg.n, None
        v = rec["n"]
        try:
            n = row_number("n", v, integer=True)
        except ValueError:
            n = 0
        if n not in BOUNDS["n"]:  # --n's own range: 1 to 128
            return 1, f"bad per-row n: {v!r}, not an integer {BOUNDS['n']}"
        return n, None

    def _tokenize(self, texts: list[str], chats: list[bool]) -> list[tuple[list[int], bool]]:
        """Chat templates already hold the model's special tokens; plain text gets them added.
        Each text's ids, and whether a text far over the limit was cut first (tokenization.py)."""
        out: list[tuple[list[int], bool]] = [([], False) for _ in texts]
        limit, policy = self.max_prompt_len, self.cfg.truncate
        for chat in (False, True):
            idx = [i for i, c in enumerate(chats) if c is chat]
            part = [texts[i] for i in idx]
            lists = tokenize_prompts(self.tokenizer, part, limit, policy, not chat)
            for i, ids in zip(idx, lists, strict=True):
                out[i] = ids
        return out

    def longest_row(self, done: set[Any]) -> int:
        """Cache slots the job's longest request needs, from a pass over the whole input
        (what `batchgen plan` reports)."""
        windows = (w for _, w in self.windows(done))
        return max((r.longest_tokens for w in windows for r in w.requests), default=1)

    def _check_id(self, rid: Any) -> None:
        """A null id (checked as the job opened too); uniqueness: only there (the module's
        docstring)."""
        if self.id_column and rid is None:
            raise InputError(f"id column {self.id_column!r} has a null value; ids must be set")
