"""--prio: the scheduling priority of a process's threads, at llama.cpp's levels.

| level | name | Linux scheduling |
|---|---|---|
| -1 | low | SCHED_BATCH (a waking thread never preempts a running one) |
| 0 | normal | left as started |
| 1 | medium | SCHED_FIFO 40 |
| 2 | high | SCHED_FIFO 80 |
| 3 | realtime | SCHED_FIFO 90 |

Under SCHED_FIFO a thread runs until it blocks: compute is not time-sliced against the event loop,
the other pipeline group's host work or other programs, so a split's stages are not stretched by
sharing a core three ways (docs/pipeline-groups.md has the measurement). The calling thread is set,
and threads started later inherit the class of the thread that starts them, so calling this before
the server starts its threads covers all of them. Threads that already exist keep theirs: those
are the BLAS library's workers (started when numpy loads): while they spun waiting for work, a
SCHED_FIFO worker held its core against the compute threads (f32 `-t 2` lost 7-11% that way; at
their normal priority they are preempted instead). The package now makes them sleep when idle. The kernel keeps 5% of
each second for ordinary threads (sched_rt_runtime_us), so a busy server does not lock the machine
out, but it does crowd out everything else on its cores: it is opt-in, as in llama.cpp.

SCHED_FIFO needs root, CAP_SYS_NICE or an RLIMIT_RTPRIO at least the level's priority; without
them the threads keep their priority and one warning says why (llama.cpp warns likewise).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

log = logging.getLogger("pyllama.util.priority")

LEVELS = {-1: "low", 0: "normal", 1: "medium", 2: "high", 3: "realtime"}
_FIFO_PRIORITY = {1: 40, 2: 80, 3: 90}
# the levels as every --prio help lists them, from the two tables above
LEVELS_HELP = (f"-1 {LEVELS[-1]} (SCHED_BATCH), " + ", ".join(f"{k} {LEVELS[k]}" for k in (0, 1, 2, 3))
               + f" (SCHED_FIFO {' / '.join(str(v) for v in _FIFO_PRIORITY.values())}; needs root or CAP_SYS_NICE)")


def check_level(level: int, flag: str = "--prio") -> Optional[str]:
    """Why a --prio value is refused, or None."""
    if level not in LEVELS:
        names = ", ".join(f"{k} ({v})" for k, v in LEVELS.items())
        return f"{flag} {level}: must be one of {names}"
    return None


def policy_for(level: int) -> Optional[tuple[int, int]]:
    """(policy, static priority) of a level; None for normal (threads keep what they have)."""
    if level == -1:
        return os.SCHED_BATCH, 0
    if level in _FIFO_PRIORITY:
        return os.SCHED_FIFO, _FIFO_PRIORITY[level]
    return None


def apply_priority(level: int, flag: str = "--prio") -> bool:
    """Sets the calling thread, and so every thread it or its descendants start from now on, to
    `level`; False (with a warning) where the system refuses."""
    why = check_level(level, flag)
    if why is not None:
        raise ValueError(why)
    target = policy_for(level)
    if target is None:
        return True
    policy, prio = target
    name = LEVELS[level]
    if not hasattr(os, "sched_setscheduler"):
        log.warning("%s %d (%s): thread priorities cannot be set on this system; left as they are", flag, level, name)
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(prio))  # 0: the calling thread (Linux)
    except PermissionError:
        log.warning("%s %d (%s): not permitted (SCHED_FIFO needs root, CAP_SYS_NICE or ulimit -r %d); threads "
                    "keep their priority", flag, level, name, prio)
        return False
    except OSError as exc:
        log.warning("%s %d (%s): %s; threads keep their priority", flag, level, name, exc.strerror or exc)
        return False
    log.info("%s %d (%s): %s for this thread and every thread started after it", flag, level, name,
             "SCHED_BATCH" if policy == os.SCHED_BATCH else f"SCHED_FIFO {prio}")
    return True
