"""Each row's sampling seed, derived from the job's seed and what names the row.

Rows of a job must sample independently: eight rows with one prompt give eight answers, not
one answer eight times, which is what a single job-wide seed gave. Yet a row must give the
same output alone, in any batch, in any input order, under --limit and on a rerun. So a row's
seed is a stable hash of exactly the things that name it: the job's seed, the row's id (in the
canonical encoding sharding uses, so 1 and "1" differ and every process agrees), and which
sample of the row it is (always 0 until a row can ask for several). BLAKE2b, not Python's
hash(), which is salted per process. A `seed` input column sets a row's seed directly instead.
"""

from __future__ import annotations

import hashlib
from typing import Any

from batchgen.job.shard import id_bytes

SEED_RANGE = 1 << 31  # DecodeParams.seed lies in [0, 2**31)


def row_seed(job_seed: int, row_id: Any, sample: int = 0) -> int:
    """The seed of sample `sample` of row `row_id` in a job seeded `job_seed`."""
    # The two integers are decimal and colon-terminated, so the id's bytes can follow freely.
    key = b"%d:%d:" % (job_seed, sample) + id_bytes(row_id)
    digest = hashlib.blake2b(key, digest_size=8, person=b"batchgen-seed").digest()
    return int.from_bytes(digest, "little") % SEED_RANGE
