"""A `logit_bias` input column read as a struct, compacted before its rows become dicts.

pyarrow's JSON reader makes an object column a struct whose fields are every key of every row
of the block: rows each biasing their own token give a struct of as many fields as rows, and
each row's dict then holds every field, mostly None (measured: 3000 rows of `{"<id>": 1}`, a
158 KB file, +300 MB as dicts; compacted first, +37 MB; issue 38 saw > 8 GB at 8192). Here
each row keeps only its own entries, as JSON text, which `logit_bias_pairs` reads (and bounds)
row by row, and which the output copies (passthrough) in its place.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

BIAS_COLUMN = "logit_bias"


def compact_bias_column(batch: pa.RecordBatch) -> pa.RecordBatch:
    """batch with a struct-typed logit_bias column as JSON text of each row's set entries
    (null where the row has none); any other batch as it is."""
    i = batch.schema.get_field_index(BIAS_COLUMN)
    if i < 0 or not pa.types.is_struct(batch.schema.field(i).type):
        return batch
    column = batch.column(i)
    rows: list[dict[str, object]] = [{} for _ in range(len(column))]
    for field, child in zip(column.type, column.flatten(), strict=True):  # field by field
        set_rows = pc.indices_nonzero(child.is_valid())
        if len(set_rows):
            values = child.take(set_rows).to_pylist()
            for r, v in zip(set_rows.to_pylist(), values, strict=True):
                rows[r][field.name] = v
    text = pa.array([json.dumps(d) if d else None for d in rows], pa.string())
    return batch.set_column(i, pa.field(BIAS_COLUMN, pa.string()), text)


def compact_field(field: pa.Field) -> pa.Field:
    """An input field as the output copies it: a struct logit_bias as its JSON text."""
    if field.name == BIAS_COLUMN and pa.types.is_struct(field.type):
        return pa.field(BIAS_COLUMN, pa.string())
    return field
