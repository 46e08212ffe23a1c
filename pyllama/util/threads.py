"""Threads that carry their names where the operating system shows them.

Python before 3.14 keeps a thread's name to itself: `top -H`, `ps -L`, `/proc/PID/task/TID/comm`,
perf and the scheduler tools (`chrt -p`, `taskset -p`) see every thread of a server as `python`.
`Thread` sets the OS name to the Python name as the thread starts (Linux keeps 15 bytes of it), so
the decode threads, the rpc server's executors and the helpers can be told apart, measured
(`bench/thread_stats.py`) and given a scheduling policy or cores one by one. The main thread
keeps its name: on Linux it is the process's name, which `ps`, `pgrep` and `pkill` match.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

OS_NAME_MAX = 15  # bytes Linux keeps of a thread's name (TASK_COMM_LEN less the terminating NUL)
_PR_SET_NAME = 15

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        _prctl = None


def os_name(name: str) -> bytes:
    """The bytes the OS keeps of `name`: UTF-8, cut to OS_NAME_MAX bytes on a character boundary."""
    raw = name.encode("utf-8")[:OS_NAME_MAX]
    return raw.decode("utf-8", "ignore").encode("utf-8")


def set_os_name(name: str) -> bool:
    """Names the calling thread for the OS; False where the platform has no such name."""
    if _prctl is None:
        return False
    return _prctl(_PR_SET_NAME, ctypes.c_char_p(os_name(name)), 0, 0, 0) == 0


def name_current_thread() -> bool:
    """set_os_name with the calling thread's Python name (an executor's `initializer`)."""
    return set_os_name(threading.current_thread().name)


class Thread(threading.Thread):
    """threading.Thread whose OS name is its Python name (set as it starts)."""

    def run(self) -> None:
        set_os_name(self.name)
        super().run()
