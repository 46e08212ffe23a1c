"""--context-shift / --no-context-shift and n_keep, as llama-server: a request for more tokens than
its slot holds generates them all with shift on (truncated: true), and stops at the limit with shift
off (truncated: true, stop_type limit)."""
from __future__ import annotations

import re

import pytest

from server_util import ServerProcess

N_CTX = 64  # per slot (-np 1)
PROMPT = "Once upon a time there"


@pytest.fixture(scope="module")
def shift_on(tiny_model):
    srv = ServerProcess(tiny_model, "-c", str(N_CTX), "--context-shift", "-v").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def shift_off(tiny_model):
    srv = ServerProcess(tiny_model, "-c", str(N_CTX), "-v").wait_ready()
    yield srv
    srv.stop()


def n_prompt(srv: ServerProcess) -> int:
    status, res = srv.post("/tokenize", {"content": PROMPT, "add_special": True})
    assert status == 200
    return len(res["tokens"])


def shifts_logged(srv: ServerProcess) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m)) for m in re.findall(r"context shift: n_keep = (\d+), n_left = (\d+), n_discard = (\d+)",
                                                   srv.log_tail(10**6))]


def test_shift_on_generates_past_the_context(shift_on):
    srv = shift_on
    req = {"prompt": PROMPT, "n_predict": 3 * N_CTX, "temperature": 0, "ignore_eos": True, "n_keep": 4,
           "return_tokens": True}
    status, res = srv.post("/completion", req)
    assert status == 200, res
    assert res["tokens_predicted"] == 3 * N_CTX and len(res["tokens"]) == 3 * N_CTX
    assert res["truncated"] is True and res["stop_type"] == "limit"
    assert res["tokens_cached"] <= N_CTX
    assert res["generation_settings"]["n_keep"] == 4
    status, props = srv.request("GET", "/props")
    assert props["context_shift"] is True and props["n_context_shifts"] >= 2
    _, tok = srv.post("/tokenize", {"content": "x", "add_special": True})
    add_bos = len(tok["tokens"]) - len(srv.post("/tokenize", {"content": "x"})[1]["tokens"])
    shifts = shifts_logged(srv)
    assert shifts and all(k == 4 + add_bos for k, _, _ in shifts)
    assert all(d == left // 2 for _, left, d in shifts)
    # the text goes on: streamed, the same tokens arrive, and the final event says truncated
    events = srv.stream("/completion", req)
    assert [t for e in events for t in e["tokens"]] == res["tokens"]
    assert events[-1]["truncated"] is True


def test_shift_keeps_the_whole_prompt_with_n_keep_minus_one(shift_on):
    srv = shift_on
    before = len(shifts_logged(srv))
    status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": 2 * N_CTX, "ignore_eos": True,
                                           "n_keep": -1, "temperature": 0})
    assert status == 200 and res["tokens_predicted"] == 2 * N_CTX and res["truncated"]
    _, tok = srv.post("/tokenize", {"content": "x", "add_special": True})
    add_bos = len(tok["tokens"]) - len(srv.post("/tokenize", {"content": "x"})[1]["tokens"])
    new = shifts_logged(srv)[before:]
    assert new and all(k == n_prompt(srv) + add_bos for k, _, _ in new)


def test_shift_off_stops_at_the_limit(shift_off):
    srv = shift_off
    status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": 3 * N_CTX, "ignore_eos": True})
    assert status == 200, res
    assert res["truncated"] is True and res["stop_type"] == "limit"
    assert res["tokens_predicted"] == N_CTX - n_prompt(srv) + 1
    assert res["tokens_cached"] == N_CTX
    events = srv.stream("/completion", {"prompt": PROMPT, "n_predict": 3 * N_CTX, "ignore_eos": True})
    assert events[-1]["truncated"] is True and events[-1]["stop_type"] == "limit"
    # an ordinary n_predict stop is not truncated
    status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": 5, "ignore_eos": True})
    assert res["truncated"] is False and res["stop_type"] == "limit" and res["tokens_predicted"] == 5
    status, props = srv.request("GET", "/props")
    assert props["context_shift"] is False and props["n_context_shifts"] == 0
    assert not shifts_logged(srv)


def test_one_info_line_per_finished_request(shift_off):
    srv = shift_off
    status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": 3, "ignore_eos": True})
    assert status == 200
    lines = [ln for ln in srv.log_tail(10**6).splitlines() if " INFO " in ln and " done (" in ln]
    assert lines, srv.log_tail()
    last = lines[-1]
    assert f"slot {res['id_slot']}:" in last and f"prompt {n_prompt(srv)} tokens" in last
    assert "3 tokens generated in" in last


def test_keep_flag_is_checked(tiny_model):
    srv = ServerProcess(tiny_model, "--keep", "-2")
    assert srv.proc.wait(60) == 1
    srv.stop()
    assert "--keep" in srv.stderr_text


def test_n_discard_sets_what_a_shift_drops(shift_on):
    srv = shift_on
    before = len(shifts_logged(srv))
    status, res = srv.post("/completion", {"prompt": PROMPT, "n_predict": 2 * N_CTX, "ignore_eos": True,
                                           "n_keep": 4, "n_discard": 5, "temperature": 0})
    assert status == 200 and res["tokens_predicted"] == 2 * N_CTX and res["truncated"]
    assert res["generation_settings"]["n_discard"] == 5
    new = shifts_logged(srv)[before:]
    assert new and all(d == 5 for _, _, d in new), new
