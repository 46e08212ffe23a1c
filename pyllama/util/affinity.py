"""llama.cpp's CPU affinity flags: -C/--cpu-mask (hex) and -Cr/--cpu-range (lo-hi) name the CPUs
the compute may run on; their union is applied to the whole process before any thread starts."""
from __future__ import annotations

import os
from typing import Optional

from .errors import PyllamaError


def cpu_set(mask: Optional[str], ranges: Optional[str], flags: str = "-C/-Cr") -> Optional[set[int]]:
    """The CPUs of a hex mask (bit i: CPU i, '0x' optional) and 'lo-hi' ranges (comma-separated),
    united; None when neither is given. PyllamaError for a malformed value or an empty set."""
    if not mask and not ranges:
        return None
    cpus: set[int] = set()
    if mask:
        text = mask.strip().lower()
        text = text[2:] if text.startswith("0x") else text
        try:
            bits = int(text, 16)
        except ValueError:
            raise PyllamaError(f"--cpu-mask {mask}: expected a hexadecimal mask, e.g. 0x3") from None
        cpus |= {i for i in range(bits.bit_length()) if bits >> i & 1}
    for part in (ranges or "").split(","):
        if not part.strip():
            continue
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi if sep else lo)
        except ValueError:
            raise PyllamaError(f"--cpu-range {ranges}: expected lo-hi, e.g. 0-3") from None
        if a < 0 or b < a:
            raise PyllamaError(f"--cpu-range {ranges}: expected lo-hi with 0 <= lo <= hi")
        cpus |= set(range(a, b + 1))
    if not cpus:
        raise PyllamaError(f"{flags}: no CPU is named")
    return cpus


def apply_affinity(cpus: Optional[set[int]], flags: str = "-C/-Cr") -> None:
    """Restricts every thread of this process (those already running, such as the BLAS library's
    workers that start with numpy, and so every thread started from now on) to `cpus`; PyllamaError
    naming the CPUs the machine lacks when none of them is available."""
    if cpus is None:
        return
    allowed = os.sched_getaffinity(0)
    usable = cpus & allowed
    if not usable:
        raise PyllamaError(f"{flags}: none of CPUs {sorted(cpus)} is available to this process "
                           f"(available: {sorted(allowed)})")
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, usable)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass
    os.sched_setaffinity(0, usable)
