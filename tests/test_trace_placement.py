"""Placement of a request with n > 1 choices under pipeline groups (what bench/trace_overhead.py's
multi-group legs rely on): every choice goes to one group with enough free slots, whichever group
that is; n above the slots of a group is a 400 naming the field."""
from __future__ import annotations

import json
import socket
import time

import pytest

from server_util import ServerProcess


@pytest.fixture(scope="module")
def srv(tiny_model: str):
    # two groups of two slots: slots 0, 1 in group 0 and 2, 3 in group 1
    s = ServerProcess(tiny_model, "--pipeline-groups", "2", "-np", "4", "-c", "2048", "-t", "1").wait_ready(120)
    yield s
    assert s.stop() == 0


def _hold(srv: ServerProcess, slot: int) -> socket.socket:
    """A long streamed generation pinned to `slot`, returned once it produces tokens (the slot is
    busy until the socket closes)."""
    body = json.dumps({"prompt": "Once upon a time", "n_predict": 4000, "stream": True, "ignore_eos": True,
                       "id_slot": slot}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Length: " + str(len(body)).encode()
              + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 2:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return s


def _release(srv: ServerProcess, s: socket.socket) -> None:
    s.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, slots = srv.request("GET", "/slots")
        if not any(x["is_processing"] for x in slots):
            return
        time.sleep(0.05)
    raise AssertionError(f"a slot stayed busy: {slots}")


@pytest.mark.parametrize("busy, want", [(0, {2, 3}), (3, {0, 1})])
def test_n_choices_go_to_the_group_with_enough_free_slots(srv: ServerProcess, busy: int, want: set[int]) -> None:
    """With one slot of a group busy, that group has one free slot and the other two: both choices
    of an n=2 request go to the other group, at once (not after the busy slot frees)."""
    held = _hold(srv, busy)
    try:
        t0 = time.monotonic()
        status, res = srv.post("/completion", {"prompt": "A B C", "n_predict": 4, "n_cmpl": 2, "temperature": 0,
                                               "ignore_eos": True})
        assert status == 200, res
        assert isinstance(res, list) and len(res) == 2
        assert {r["id_slot"] for r in res} == want
        assert all(r["tokens_predicted"] == 4 for r in res)
        assert time.monotonic() - t0 < 30  # placed while the other group's slot was still busy
        _, slots = srv.request("GET", "/slots")
        assert next(x for x in slots if x["id"] == busy)["is_processing"]
    finally:
        _release(srv, held)


@pytest.mark.parametrize("field", ["n", "n_cmpl"])
def test_n_above_a_group_s_slots_is_a_400_naming_the_field(srv: ServerProcess, field: str) -> None:
    status, res = srv.post("/completion", {"prompt": "A B C", "n_predict": 2, field: 3})
    assert status == 400
    text = json.dumps(res)
    assert "'n'" in text and "2 slots per group" in text
    status, res = srv.post("/completion", {"prompt": "A B C", "n_predict": 2, "temperature": 0, field: 2})
    assert status == 200 and len(res) == 2  # exactly a group's slots is fine
