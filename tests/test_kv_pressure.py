"""A full unified KV pool never fails a request because of another: concurrent requests whose total
need exceeds the pool all complete, preempted and recomputed where needed, with the text they have
when sent one at a time (temperature 0); locally, over two pipeline groups and over an rpc server.

Exactness holds for steps of at most `gemm.small_rows_max()` rows (the exact kernels); a larger step
runs on BLAS, whose rows differ in the last bits, as llama.cpp's results differ with the batch. The
prompts are short enough that no step of these tests can exceed it, whatever arrives together."""
from __future__ import annotations

import re
import threading

import pytest

from pyllama._fast import gemm
from server_util import RPCServerProcess, ServerProcess

PROMPTS = ["The cat sat", "Once upon", "In a hole", "1, 2, 3,"]
N_PREDICT = 100  # prompt + 100 tokens each: about 420 cells for 4 requests in a pool of 256


def body(prompt: str, n_predict: int = N_PREDICT) -> dict:
    # the probabilities too: a recomputed K/V that differs in the last bit shows there
    return {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "n_probs": 2}


def result(res: dict) -> tuple:
    """Text plus every token's probabilities, compared exactly."""
    return res["content"], [(p["id"], p["logprob"], [(t["id"], t["logprob"]) for t in p["top_logprobs"]])
                            for p in res["completion_probabilities"]]


def preemptions(srv: ServerProcess) -> int:
    status, text = srv.request("GET", "/metrics")
    assert status == 200
    m = re.search(r"^llamacpp:n_preemptions_total (\d+)$", text, re.M)
    assert m, text
    return int(m.group(1))


def check_prompts_fit_exact_steps(srv: ServerProcess) -> None:
    """Every prompt (with BOS) computed in one step beside a decode row of every request stays
    within the exact kernels' rows: no timing can batch these tests onto BLAS."""
    rows = len(PROMPTS)
    for p in PROMPTS:
        status, res = srv.post("/tokenize", {"content": p, "add_special": True})
        assert status == 200, res
        rows += len(res["tokens"])
    assert rows <= gemm.small_rows_max(), rows


def one_at_a_time(srv: ServerProcess, n_predict: int = N_PREDICT) -> list[tuple]:
    check_prompts_fit_exact_steps(srv)
    out = []
    for p in PROMPTS:
        status, res = srv.post("/completion", body(p, n_predict))
        assert status == 200, res
        assert res["tokens_predicted"] == n_predict and not res["truncated"]
        out.append(result(res))
    return out


def all_at_once(srv: ServerProcess, stream: bool, n_predict: int = N_PREDICT) -> list[tuple]:
    results: list = [None] * len(PROMPTS)

    def run(i: int) -> None:
        if stream:
            events = srv.stream("/completion", body(PROMPTS[i], n_predict), timeout=120)
            results[i] = (200, events)
        else:
            results[i] = srv.post("/completion", body(PROMPTS[i], n_predict), timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    texts = []
    for status, res in results:
        assert status == 200, res
        if stream:
            assert all("error" not in e for e in res), res
            final = res[-1]
            assert final["stop"] and final["tokens_predicted"] == n_predict
            assert all(e["id_slot"] == final["id_slot"] for e in res)
            final["content"] = "".join(e["content"] for e in res)
            final["completion_probabilities"] = [p for e in res[:-1] for p in e["completion_probabilities"]]
            texts.append(result(final))
        else:
            assert res["tokens_predicted"] == n_predict and res["stop_type"] == "limit"
            assert res["tokens_cached"] <= 256
            texts.append(result(res))
    return texts


def check_server(srv: ServerProcess) -> None:
    alone = one_at_a_time(srv)
    before = preemptions(srv)
    for stream in (False, True):
        assert all_at_once(srv, stream) == alone
    assert preemptions(srv) > before  # the pool really ran out
    status, props = srv.request("GET", "/props")
    assert status == 200 and props["n_preemptions"] == preemptions(srv)
    status, health = srv.request("GET", "/health")
    assert status == 200, health


def test_full_pool_preempts_instead_of_failing(tiny_model):
    srv = ServerProcess(tiny_model, "--metrics", "-c", "256", "-np", "4", "--kv-unified").wait_ready()
    try:
        check_server(srv)
    finally:
        assert srv.stop() == 0


def test_full_pool_two_pipeline_groups(tiny_model):
    srv = ServerProcess(tiny_model, "--metrics", "-c", "256", "-np", "4", "--kv-unified", "--pipeline-groups", "2").wait_ready()
    try:
        # two groups of two slots, each with its own pool of 256: two requests of about 150 cells
        # overflow a group's pool whichever two requests it gets
        alone = one_at_a_time(srv, 140)
        before = preemptions(srv)
        for stream in (False, True):
            assert all_at_once(srv, stream, 140) == alone
        assert preemptions(srv) > before
    finally:
        assert srv.stop() == 0


def test_full_pool_over_rpc(tiny_model):
    peer = RPCServerProcess()
    try:
        srv = ServerProcess(tiny_model, "--metrics", "-c", "256", "-np", "4", "--kv-unified", "--rpc", peer.endpoint,
                            "--device", "RPC0,CPU").wait_ready()
        try:
            check_server(srv)
        finally:
            assert srv.stop() == 0
    finally:
        peer.stop()


def test_prompt_that_can_never_fit_is_refused_before_any_work(tiny_model):
    srv = ServerProcess(tiny_model, "-c", "64", "-np", "2", "--kv-unified").wait_ready()
    try:
        status, res = srv.post("/completion", {"prompt": list(range(10, 80)), "n_predict": 4})
        assert status == 400 and res["error"]["type"] == "exceed_context_size_error"
        # a short and a long request together: both complete (the short one is not failed by the long one)
        results: list = [None, None]

        def run(i: int, b: dict) -> None:
            results[i] = srv.post("/completion", b, timeout=120)

        ts = [threading.Thread(target=run, args=(0, {"prompt": "Hi", "n_predict": 8, "ignore_eos": True})),
              threading.Thread(target=run, args=(1, {"prompt": "Once upon a time", "n_predict": 100,
                                                     "ignore_eos": True}))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(150)
        assert results[0][0] == 200 and results[0][1]["tokens_predicted"] == 8, results[0]
        status, long = results[1]
        assert status == 200, long
        assert long["truncated"] and long["stop_type"] == "limit" and long["tokens_cached"] <= 64
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("n", [2])
def test_choices_share_a_full_pool(tiny_model, n):
    """n > 1 choices (shared prompt blocks) next to another request in a pool too small for all."""
    srv = ServerProcess(tiny_model, "-c", "160", "-np", "3", "--kv-unified").wait_ready()
    try:
        req = {"prompt": "Once upon a time", "n_predict": 70, "temperature": 0, "ignore_eos": True}
        status, alone = srv.post("/completion", req)
        assert status == 200
        results: list = [None, None]

        def run(i: int, b: dict) -> None:
            results[i] = srv.post("/completion", b, timeout=120)

        ts = [threading.Thread(target=run, args=(0, {**req, "n": n})),
              threading.Thread(target=run, args=(1, {**req, "prompt": "1, 2, 3,"}))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(150)
        status, choices = results[0]
        assert status == 200, choices
        assert [c["content"] for c in choices] == [alone["content"]] * n
        assert results[1][0] == 200, results[1]
    finally:
        assert srv.stop() == 0
