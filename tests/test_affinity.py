"""llama.cpp's CPU affinity flags (-C/--cpu-mask, -Cr/--cpu-range): parsed into a set of CPUs
and applied to every thread of the process; malformed or impossible values are one error."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pyllama.util.affinity import cpu_set
from pyllama.util.errors import PyllamaError


def test_masks_and_ranges():
    assert cpu_set(None, None) is None
    assert cpu_set("0x5", None) == {0, 2}
    assert cpu_set("3", "4-5") == {0, 1, 4, 5}
    assert cpu_set(None, "0-1,3") == {0, 1, 3}
    for mask, ranges in (("xyz", None), (None, "3-1"), (None, "a-b"), ("0", None)):
        with pytest.raises(PyllamaError):
            cpu_set(mask, ranges)


def test_every_thread_runs_on_the_chosen_cpus():
    """In a fresh process with the BLAS library's workers already running (numpy imported), every
    thread, those and a new one, ends up on CPU 0 alone."""
    code = """
import os, threading
import numpy as np
np.ones((256, 256)) @ np.ones((256, 256))
from pyllama.util.affinity import apply_affinity, cpu_set
apply_affinity(cpu_set(None, "0-0"))
t = threading.Thread(target=lambda: None); t.start(); t.join()
print(sorted({frozenset(os.sched_getaffinity(int(tid))) == frozenset({0}) for tid in os.listdir('/proc/self/task')}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[True]"


def test_a_cpu_the_machine_lacks_is_one_error():
    proc = subprocess.run([sys.executable, "-m", "pyllama.server", "--port", "0", "-C", hex(1 << (os.cpu_count() + 8))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "-C/-Cr: none of CPUs" in proc.stderr and "Traceback" not in proc.stderr
