"""The id column, checked before the model loads: its type, and every value set and unique.

Ids decide exactly-once output (a rerun skips the ids already written) and sharding (a hash of
the id), so a bad id column must stop the job before it starts, not after the model has loaded
or parts have been written. Reading one column with pyarrow is cheap next to a model load: one
pass over it finds nulls and duplicates anywhere in the input, not only in the first window.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.data import InputSource
from batchgen.errors import InputError

# The fix for bad ids where row numbers would do.
ROW_NUMBERS_FIX = "use row numbers as ids (no --id-column, and no input column named id)"
ID_TYPES = "integers or strings (or bytes, dates, timestamps, decimals)"
# Rows of the id column read at a time by the up-front check.
_CHECK_ROWS = 1 << 16


def check_id_type(source: InputSource, id_column: str) -> None:
    """InputError for an id column that cannot key a row: floats (NaN equals nothing, not even
    itself: a NaN-id row would never count as done), booleans (two values), lists, structs and
    maps (a row's id is one value), or nulls only."""
    kind = source.schema.field(id_column).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    bad = (
        pa.types.is_nested(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_null(kind)
    )
    if bad:
        why = " (NaN never equals itself)" if pa.types.is_floating(kind) else ""
        raise InputError(
            f"id column {id_column!r} is of type {kind}{why}, and ids must be {ID_TYPES} for "
            f"exactly-once output; cast it to int or string, or {ROW_NUMBERS_FIX}"
        )


def check_unique_ids(source: InputSource, id_column: str, limit: int | None) -> None:
    """InputError naming a null or repeated id among the first `limit` rows (all: None)."""
    chunks: list[pa.Array] = []
    rows = 0
    for _, batch in source.iter_batches(_CHECK_ROWS, columns=[id_column]):
        column = batch.column(0)
        if limit is not None and rows + len(column) > limit:
            column = column.slice(0, limit - rows)
        chunks.append(column)
        rows += len(column)
        if column.null_count:
            row = rows - len(column) + pc.index(column.is_null(), True).as_py()
            raise InputError(
                f"id column {id_column!r} has a null value (input row {row}); ids must be set; "
                f"fix the input, or {ROW_NUMBERS_FIX}"
            )
        if limit is not None and rows >= limit:
            break
    if not chunks:
        return
    ids = pa.chunked_array(chunks)
    counts = pc.value_counts(ids)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        first = repeated[0].as_py()
        times = "twice" if first["counts"] == 2 else f"{first['counts']} times"
        raise InputError(
            f"id column {id_column!r} has the value {first['values']!r} {times} "
            f"({len(repeated)} repeated value(s) in all); ids must be unique for exactly-once "
            f"output; fix the input, or {ROW_NUMBERS_FIX}"
        )
