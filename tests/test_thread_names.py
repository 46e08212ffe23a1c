"""pyllama's threads carry their names where the OS shows them (/proc/PID/task/TID/comm, top -H,
ps -L): the decode threads, the task thread, the rpc server's executors, the kernel pool's helpers."""
from __future__ import annotations

import os
import sys
import threading
from typing import Optional

import pytest

from pyllama.batching.constraint import Constraint, MaskWorker
from pyllama.util.threads import OS_NAME_MAX, Thread, os_name
from server_util import RPCServerProcess, ServerProcess

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names read from Linux's /proc")


def read_os_name(native_id: int, pid: Optional[int] = None) -> Optional[str]:
    """A thread's OS name from /proc (None once the thread is gone)."""
    try:
        with open(f"/proc/{pid if pid is not None else 'self'}/task/{native_id}/comm", encoding="utf-8") as f:
            return f.read().rstrip("\n")
    except OSError:
        return None


def _os_name_seen_by(make_thread) -> str:
    seen: list = []
    t = make_thread(lambda: seen.append(read_os_name(threading.get_native_id())))
    t.start()
    t.join(10)
    return seen[0]


def _names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = read_os_name(int(tid), pid)
        if name is not None:
            names.append(name)
    return names


def test_a_plain_python_thread_shows_the_process_name():
    # why the module exists: before Python 3.14 the OS sees every thread under the process's name
    name = _os_name_seen_by(lambda fn: threading.Thread(target=fn, name="decode-7"))
    assert name == read_os_name(threading.main_thread().native_id)
    assert name != "decode-7"


def test_thread_sets_its_os_name():
    assert _os_name_seen_by(lambda fn: Thread(target=fn, name="decode-7")) == "decode-7"


def test_long_names_are_cut_to_what_linux_keeps():
    assert os_name("rpc-cache-writer") == b"rpc-cache-write"
    assert len(os_name("x" * 40)) == OS_NAME_MAX
    # a multi-byte character that does not fit whole is left out, never cut in half
    assert os_name("decode-" + "\u00e9" * 5) == ("decode-" + "\u00e9" * 4).encode()
    assert _os_name_seen_by(lambda fn: Thread(target=fn, name="rpc-cache-writer")) == "rpc-cache-write"


def test_mask_worker_thread_is_named():
    seen: list = []

    class Matcher:
        def unsafe_compute_mask_ptr(self, ptr, nbytes):
            seen.append(read_os_name(threading.get_native_id()))

    worker = MaskWorker("masks-3")
    c = Constraint(Matcher(), 64)
    worker.request_mask([c])
    c.take_mask()
    worker.close()
    assert seen == ["masks-3"]


def test_server_and_rpc_server_threads_are_named(tiny_model):
    rpc = RPCServerProcess()
    srv = None
    try:
        srv = ServerProcess(tiny_model, "--rpc", rpc.endpoint, "--device", "RPC0,CPU", "-c", "256", "-np", "2",
                            "--pipeline-groups", "2", "-t", "2").wait_ready()
        status, body = srv.post("/completion", {"prompt": "hello world, " * 8, "n_predict": 4, "ignore_eos": True})
        assert status == 200 and body["tokens_predicted"] == 4
        server_names = _names(srv.proc.pid)
        rpc_names = _names(rpc.proc.pid)
    finally:
        if srv is not None:
            srv.stop()
        rpc.stop()
    for name in ("decode-0", "decode-1", "tasks", "reconnect", "kernel-pool"):
        assert name in server_names, server_names
    assert any(n.startswith("rpc-exec-") for n in rpc_names), rpc_names  # one per connection (lane)
