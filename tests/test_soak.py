"""bench/soak.py: its response checks and memory figures, and a short soak over a two-group split of
the tiny model (rpc server + server, streaming clients, SIGTERM under load)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "soak.py")

_spec = importlib.util.spec_from_file_location("soak", SCRIPT)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def _completion_req(n_predict=3, stops=(), id_len=4):
    return {"kind": "completion", "n_predict": n_predict, "stops": list(stops), "id_prompt_len": id_len,
            "usage": False}


def _token(i, text="x"):
    return json.dumps({"content": text, "tokens": [7], "stop": False, "tokens_predicted": i})


def _final(n, stop_type="limit", word="", evaluated=4):
    return json.dumps({"content": "", "stop": True, "tokens_predicted": n, "tokens_evaluated": evaluated,
                       "stop_type": stop_type, "stopping_word": word, "truncated": False,
                       "timings": {"predicted_n": n}})


def _check(req, events):
    c = soak.Checker(req)
    for e in events:
        c.feed(e)
    c.finish()
    return c


def test_completion_checker():
    ok = _check(_completion_req(), [_token(1), _token(2), _token(3), _final(3)])
    assert ok.done and not ok.problems and ok.tokens == 3
    # a final event that disagrees with the token events, or a limit below n_predict
    assert _check(_completion_req(), [_token(1), _token(2), _final(3)]).problems
    assert _check(_completion_req(), [_token(1), _token(2), _final(2)]).problems
    # no final event: not done (the caller counts it as truncated)
    assert not _check(_completion_req(), [_token(1), _token(2)]).done
    # a stop string in the text, a stopping word that was not asked for, an event after the end
    assert _check(_completion_req(stops=["ab"]), [_token(1, "xa"), _token(2, "bx"), _final(2, "eos")]).problems
    assert _check(_completion_req(stops=["q"]), [_token(1), _final(1, "word", "z")]).problems
    assert _check(_completion_req(), [_token(1), _token(2), _token(3), _final(3), _token(4)]).problems
    # the prompt's length
    assert _check(_completion_req(), [_token(1), _token(2), _token(3), _final(3, evaluated=5)]).problems


def _chat(delta=None, finish=None, cid="c1"):
    choice = {"index": 0, "delta": delta if delta is not None else {}, "finish_reason": finish}
    return json.dumps({"id": cid, "object": "chat.completion.chunk", "choices": [choice]})


def _usage(n, prompt=5, cid="c1"):
    return json.dumps({"id": cid, "object": "chat.completion.chunk", "choices": [],
                       "usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}})


def test_chat_checker():
    req = {"kind": "chat", "n_predict": 2, "stops": [], "id_prompt_len": None, "usage": True}
    good = [_chat({"role": "assistant", "content": None}), _chat({"content": "a"}), _chat({"content": "b"}),
            _chat(finish="length"), _usage(2), "[DONE]"]
    c = _check(req, good)
    assert c.done and not c.problems and c.tokens == 2
    assert not _check(req, good[:-1]).done                                  # no [DONE]
    assert _check(req, good[:4] + ["[DONE]"]).problems                      # usage asked, none sent
    assert _check(req, good[:4] + [_usage(1), "[DONE]"]).problems           # length below max_tokens
    assert _check(req, good[:1] + [_chat({"content": "a"}, cid="c2")] + good[2:]).problems
    assert _check(req, good + [_chat({"content": "late"})]).problems


def test_slope_and_memory_figures():
    assert soak.slope_mib_per_min([(0, 100.0), (60, 101.0), (120, 102.0)]) == 1.0
    assert soak.slope_mib_per_min([(0, 1.0)]) is None
    samples = [{"t_s": t, "x": 100.0 + t / 60.0} for t in range(0, 101, 10)]
    m = soak.memory_figures(samples, 10, 100, "x")
    assert m["start_mib"] == samples[1]["x"] and m["end_mib"] == samples[-1]["x"]
    assert abs(m["slope_mib_per_min"] - 1.0) < 1e-9 and m["second_half_s"] == 40


def test_memory_judged_against_the_prompt_cache_limit():
    """The server's RSS may grow while its prompt cache fills up to its limit (the rest stays flat);
    growth past the limit, the cache over it, or the rest growing, fails."""
    def run(cache_mib_per_s: float, rest_mib_per_s: float, limit: float = 1000.0):
        samples = [{"t_s": t, "cache": cache_mib_per_s * t, "rest": 500.0 + rest_mib_per_s * t} for t in range(0, 181, 2)]
        for x in samples:
            x["rss"] = x["cache"] + x["rest"]
        mem = {"server": soak.memory_figures(samples, 0, 180, "rss"), "rpc": soak.memory_figures(samples, 0, 180, "rest")}
        mem["rpc"]["slope_mib_per_min"] = 0.0
        cache = {"limit_mib": limit, **soak.memory_figures(samples, 0, 180, "cache")}
        rest = soak.memory_figures(samples, 0, 180, "rest")
        return soak.judge_memory(mem, cache, rest, 5.0, 60.0, 3.0)

    assert run(5.0, 0.0) == ([], True)  # 900 MiB of cache in 3 minutes, under its 1000 MiB
    failures, _ = run(10.0, 0.0)
    assert any("over its limit" in f for f in failures) and any("beyond the prompt cache's limit" in f for f in failures)
    failures, _ = run(0.0, 0.5)  # 30 MiB/min that the cache does not account for
    assert failures == ["server RSS less its prompt cache slope 30.00 MiB/min over the second half (limit 5)"]
    empty = {"samples": 0}
    mem = {"server": {"slope_mib_per_min": 30.0, "second_half_s": 90}}
    assert soak.judge_memory(mem, {"limit_mib": None}, empty, 5.0, 60.0, 3.0)[0]  # no cache figures: RSS judged


def test_shutdown_judgement():
    t = 100.0
    reqs = [{"outcome": "complete", "t_end": 101},
            {"outcome": "truncated", "cut": "between chunks", "partial_event": False, "reset": False, "t_end": 105},
            {"outcome": "lost", "cut": "before the status line", "reset": False, "t_end": 100.5},
            {"outcome": "truncated", "cut": "mid-chunk", "partial_event": True, "reset": False, "t_end": 105},
            {"outcome": "complete", "t_end": 200},
            {}]
    j = soak.judge_shutdown(reqs, t, 30)
    assert (j["complete"], j["closed_at_event_boundary"], j["closed_before_answer"], j["unclean"]) == (1, 1, 1, 3)


def test_short_soak(tiny_model, tmp_path):
    """16 clients for 8 s over RPC0,CPU with two groups: every response complete and valid, none lost,
    SIGTERM under load ends cleanly."""
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, SCRIPT, "--model", tiny_model, "--clients", "16", "--minutes", str(8 / 60),
                        "--warmup-s", "1", "--rss-interval", "0.5", "--progress-s", "1000", "--shutdown-bound", "20",
                        "--request-timeout", "30", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((out / "summary.json").read_text())
    load = s["requests"]["load"]
    assert load["complete"] > 0 and s["tokens_load"] > 0
    for k in ("truncated", "lost", "invalid", "failed"):
        assert load[k] == 0 and s["requests"]["warmup"][k] == 0, (k, s["requests"])
    sd = s["shutdown"]
    assert sd["server_exit_status"] == 0 and not sd["server_killed"] and not sd["server_children_left"]
    assert sd["unclean"] == 0 and sd["clients_hung"] == 0
    assert sd["rpc_server"]["exit_status"] == 0 and not sd["rpc_server"]["killed"]
    assert s["memory"]["server"]["samples"] > 5 and s["memory"]["rpc"]["max_mib"] > 0
    assert (out / "rss.csv").read_text().count("\n") > 5
