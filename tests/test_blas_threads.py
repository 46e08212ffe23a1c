"""OpenBLAS (numpy's BLAS, used for F32 prompt products) must not keep a core busy between
products: its workers' busy-wait after a product took a core from the kernel pool's threads in
the ops that follow (a 512-token F32 prompt's attention ran no faster on 2 threads than on 1)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# After one BLAS product on 2 threads, the process's CPU time while its only Python thread sleeps:
# what an idle BLAS worker burns.
_IDLE_CPU = r"""
import time
import pyllama.backend.cpu as cpu
import numpy as np
from threadpoolctl import threadpool_info
if not any(i.get("internal_api") == "openblas" for i in threadpool_info()):
    print("no-openblas")
    raise SystemExit
cpu.set_compute_threads(2)
a = np.ones((512, 768), np.float32)
b = np.ones((768, 2048), np.float32)
worst = 0.0
for _ in range(3):
    a @ b
    c0 = time.process_time()
    time.sleep(0.05)
    worst = max(worst, time.process_time() - c0)
print(f"{worst:.4f}")
"""


def _run(code: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "OMP_WAIT_POLICY")}
    env.update(extra)
    return env


def test_importing_pyllama_makes_idle_workers_sleep_before_numpy_loads():
    out = _run("import os, sys, pyllama; e = os.environ; "
               "print('numpy' in sys.modules, e['OPENBLAS_THREAD_TIMEOUT'], e['OMP_WAIT_POLICY'])",
               _env())
    assert out == "False 4 PASSIVE"


def test_a_users_blas_spin_setting_is_kept():
    assert _run("import os, pyllama; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])",
                _env(OPENBLAS_THREAD_TIMEOUT="12")) == "12"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no worker on one core")
def test_idle_blas_workers_leave_the_cores_free():
    out = _run(_IDLE_CPU, _env())
    if out == "no-openblas":
        pytest.skip("numpy's BLAS is not OpenBLAS")
    # a spinning worker burns about the whole 50 ms sleep (OpenBLAS spins ~0.1 s by default)
    assert float(out) < 0.02, f"BLAS workers burned {float(out) * 1e3:.1f} ms of CPU while idle"
