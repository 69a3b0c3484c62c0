"""Import torchao without its import-time noise.

Importing torchao (directly, or through peft or optimum-quanto, which import it when it is
installed) logs a warning for each compiled extension that does not load on this machine
("Failed to load ... _C_mxfp8 ...", "... _C_cutlass_90a ...": CUDA-only kernels, expected on a
CPU machine) and torch logs deprecation notes for the enums torchao registers. None of them is
about the user's job, so they are kept out of the terminal: the imports run with those
loggers at ERROR. Only the code paths that need those libraries
(quantizing, reading a LoRA adapter's config) import them, so a plain run imports none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_torchao() -> Iterator[None]:
    """Within: torchao's import-time warnings (and torch's about its enums) are not shown.
    Wrap the imports of torchao, peft and optimum-quanto (all of their submodules)."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
