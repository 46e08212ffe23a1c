"""--prio on the server and the rpc server: llama.cpp's levels, the calling thread and every thread
started after it set (threads from before, the BLAS library's workers, left alone), refusal of
other values, a warning where the system refuses."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from pyllama.util.errors import PyllamaError
from pyllama.util.priority import LEVELS, apply_priority, check_level, policy_for
from pyllama.server.options import parse_args
from server_util import RPCServerProcess, ServerProcess

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="needs Linux scheduling calls")

_CAN_FIFO = os.geteuid() == 0  # root (CI); elsewhere CAP_SYS_NICE or RLIMIT_RTPRIO may also allow it


def test_levels_are_llama_cpps():
    assert LEVELS == {-1: "low", 0: "normal", 1: "medium", 2: "high", 3: "realtime"}
    assert policy_for(0) is None
    assert policy_for(-1) == (os.SCHED_BATCH, 0)
    assert [policy_for(n) for n in (1, 2, 3)] == [(os.SCHED_FIFO, 40), (os.SCHED_FIFO, 80), (os.SCHED_FIFO, 90)]


@pytest.mark.parametrize("level", [-2, 4, 99])
def test_other_levels_refused(level):
    why = check_level(level)
    assert why is not None and why.startswith(f"--prio {level}:") and "3 (realtime)" in why
    with pytest.raises(ValueError, match="--prio"):
        apply_priority(level)


# a process of its own: the test process's threads must keep their scheduling
_PROBE = """
import json, os, threading, time
from pyllama.util.priority import apply_priority
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
ok = apply_priority({level})
after_ids = []
def later():
    after_ids.append(threading.get_native_id()); stop.wait()
after = threading.Thread(target=later); after.start()
while not after_ids: time.sleep(0.01)
policies = {{tid: [os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority]
            for tid in (threading.get_native_id(), before.native_id, after_ids[0])}}
stop.set(); before.join(); after.join()
print(json.dumps({{"ok": ok, "policies": list(policies.values())}}))
"""


def _probe(level: int) -> tuple[dict, str]:
    run = subprocess.run([sys.executable, "-c", _PROBE.format(level=level)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout), run.stderr


def test_low_sets_the_caller_and_later_threads_batch_unprivileged():
    out, _ = _probe(-1)
    assert out["ok"] is True
    # the caller, a thread from before (left alone), one started after
    assert out["policies"] == [[os.SCHED_BATCH, 0], [os.SCHED_OTHER, 0], [os.SCHED_BATCH, 0]]


def test_medium_sets_fifo_or_warns():
    out, err = _probe(1)
    if _CAN_FIFO:
        assert out["ok"] is True
        assert out["policies"] == [[os.SCHED_FIFO, 40], [os.SCHED_OTHER, 0], [os.SCHED_FIFO, 40]]
    else:
        assert out["ok"] is False and "not permitted" in err
        assert out["policies"] == [[os.SCHED_OTHER, 0]] * 3


def test_normal_leaves_threads_alone():
    out, _ = _probe(0)
    assert out["ok"] is True and out["policies"] == [[os.SCHED_OTHER, 0]] * 3


def test_server_flags():
    assert parse_args(["-m", "M"]).prio == 0
    assert parse_args(["-m", "M", "--prio", "2"]).prio == 2
    assert parse_args(["-m", "M", "--prio", "-1"]).prio == -1
    assert parse_args(["-m", "M", "--prio-batch", "1"]).prio_batch == 1
    for argv in (["--prio", "4"], ["--prio-batch", "-5"]):
        with pytest.raises(PyllamaError, match=argv[0]):
            parse_args(["-m", "M", *argv])


def test_rpc_server_refuses_other_levels():
    run = subprocess.run([sys.executable, "-m", "pyllama.rpc_server", "--port", "0", "--prio", "7"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "--prio 7: must be one of" in run.stderr


def _thread_policies(pid: int) -> list[tuple[int, int]]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append((os.sched_getscheduler(int(tid)), os.sched_getparam(int(tid)).sched_priority))
        except ProcessLookupError:
            pass
    return out


def _threads_at_import(module: str) -> int:
    """Threads a program has before its main() runs besides the main one: the BLAS library's workers."""
    run = subprocess.run([sys.executable, "-c", f"import os, {module}; print(len(os.listdir('/proc/self/task')) - 1)"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return int(run.stdout)


def test_server_and_rpc_server_threads_take_the_level(tiny_model):
    level, expect = (1, (os.SCHED_FIFO, 40)) if _CAN_FIFO else (-1, (os.SCHED_BATCH, 0))
    rpc = RPCServerProcess("--prio", str(level))
    srv = None
    try:
        srv = ServerProcess(tiny_model, "--rpc", rpc.endpoint, "--device", "RPC0,CPU", "-c", "256", "-np", "2",
                            "--pipeline-groups", "2", "--prio", str(level)).wait_ready()
        # ignore_eos: a sampled end of text would stop the random test model before 4 tokens
        status, body = srv.post("/completion", {"prompt": "hello", "n_predict": 4, "ignore_eos": True})
        assert status == 200 and body["tokens_predicted"] == 4
        # the event loop, the task and decode threads, the executors and kernel helpers take the level;
        # only the BLAS library's workers, started when numpy loads, keep theirs
        for pid, module in ((srv.proc.pid, "pyllama.server.__main__"), (rpc.proc.pid, "pyllama.rpc_server.__main__")):
            policies = _thread_policies(pid)
            normal = [p for p in policies if p == (os.SCHED_OTHER, 0)]
            assert len(normal) == _threads_at_import(module), policies
            assert [p for p in policies if p != (os.SCHED_OTHER, 0)] == [expect] * (len(policies) - len(normal))
            assert len(policies) - len(normal) >= 3, policies
    finally:
        if srv is not None:
            srv.stop()
        rpc.stop()
    line = f"--prio {level} ({LEVELS[level]}): "
    assert line in srv.stderr_text and "every thread started after it" in srv.stderr_text
    assert any(line in x for x in rpc.log)


def test_refusal_by_the_system_is_one_warning(monkeypatch, caplog):
    calls = []

    def refuse(tid, policy, param):
        calls.append(tid)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with caplog.at_level(logging.WARNING, logger="pyllama.util.priority"):
        assert apply_priority(2) is False
    assert len(calls) == 1  # stops at the first refusal
    assert [r.getMessage() for r in caplog.records] == [
        "--prio 2 (high): not permitted (SCHED_FIFO needs root, CAP_SYS_NICE or ulimit -r 80); threads keep their "
        "priority"]
