"""How long the process ran before the job's statistics started: the start-up that a job's
`wall_s` leaves out (Python and torch imports, reading the model's config and tokenizer,
checking the input), which the user waits for all the same.

Linux gives a process's start time in /proc/self/stat (clock ticks since boot, the clock of
/proc/uptime); elsewhere it is unknown (None).
"""

from __future__ import annotations

import os


def process_age_s() -> float | None:
    """Seconds since this process started, at clock-tick resolution (10 ms); None if unknown."""
    try:
        with open("/proc/self/stat") as f:
            # after the command name (in parentheses, may hold spaces) come fields 3, 4, ...;
            # field 22 is the start time
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
