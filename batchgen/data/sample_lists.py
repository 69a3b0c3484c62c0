"""--n-as-list: a row's n sample records gathered into one, its samples' own fields
(`records.LIST_FIELDS`) as lists in sample order."""

from __future__ import annotations

from typing import Any

from batchgen.data.records import LIST_FIELDS


class SampleLists:
    """--n-as-list: holds each row's sample records until all n are in, then gives one
    record with the samples' own fields as lists and the row's fields (id, passthrough,
    prompt_tokens) once; `error` is the first sample's error, if any."""

    def __init__(self) -> None:
        self._rows: dict[Any, tuple[int, dict[int, dict[str, Any]]]] = {}  # key -> (n, samples)

    def add(self, key: Any, n: int, sample: int, rec: dict[str, Any]) -> dict[str, Any] | None:
        """Sample `sample` of the row `key` (of n samples); its row's record once complete."""
        _, got = self._rows.setdefault(key, (n, {}))
        got[sample] = rec
        if len(got) < n:
            return None
        del self._rows[key]
        samples = [got[k] for k in range(n)]
        out = {k: v for k, v in samples[0].items() if k != "sample_index"}
        for f in LIST_FIELDS:
            if f in out:
                out[f] = [s[f] for s in samples]
        out["error"] = next((s["error"] for s in samples if s["error"] is not None), None)
        return out

    @property
    def pending(self) -> int:
        """Rows with some but not all samples in."""
        return len(self._rows)
