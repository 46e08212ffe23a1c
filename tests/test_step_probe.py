"""The step probe: the one hook a decode loop reports through, and what each sink gets of a step."""
from __future__ import annotations

from types import SimpleNamespace

from pyllama.obs import pipe_prof, step_probe, trace
from pyllama.util import settings


class _Clock:
    def __init__(self) -> None:
        self.t = 1000

    def __call__(self) -> int:
        self.t += 10
        return self.t


def _step(probe: step_probe.StepProbe, sampled: bool = True) -> None:
    probe.begin()
    probe.built(n_tokens=7, n_rows=3, n_decode=2)
    probe.decoded(SimpleNamespace(last_spans=(1025, 1027, 1029), last_submit_s=0.25, last_sync_s=0.5))
    if sampled:
        probe.sampling()
        probe.sampled(mask_wait_s=1e-6, mask_apply_s=2e-6)
    probe.post_done([SimpleNamespace(t_detok=1e-6, t_stop=4e-6), SimpleNamespace(t_detok=2e-6, t_stop=0.0)])
    probe.sending()
    probe.end(lock_wait_s=0.125)


def test_a_traced_step_tells_every_sink(monkeypatch):
    monkeypatch.setattr(step_probe, "_now", _Clock())
    events = []
    monkeypatch.setattr(trace, "enabled", True)
    monkeypatch.setattr(trace, "event", lambda c, n, t0, t1, **f: events.append((n, t0, t1, f)))
    added = []
    prof = SimpleNamespace(add=lambda steps=0, tokens=0, **s: added.append((steps, tokens, s)))
    monkeypatch.setattr(pipe_prof, "profile_for", lambda group: prof)
    with settings.override(obs={"pipe_prof": True}):
        probe = step_probe.StepProbe(3)
    _step(probe)
    names = [e[0] for e in events]
    assert names == ["batch_build", "submit", "synchronize", "sampling", "post_decode", "result_send", "iteration"]
    spans = {n: (t0, t1) for n, t0, t1, _ in events}
    assert spans["batch_build"] == (1010, 1020) and spans["submit"] == (1025, 1027)
    assert spans["sampling"] == (1040, 1050) and spans["post_decode"] == (1030, 1060)
    assert spans["result_send"] == (1070, 1080) and spans["iteration"] == (1010, 1080)
    it = events[-1][3]
    assert it == {"grp": 3, "n_slots": 3, "n_prompt": 5, "n_decode": 2}
    assert list(probe.steps.steps) == [(1010, 1080, 7, 3)]
    (s0, t0, lock), (s1, t1, phases), (s2, t2, per_token) = added
    assert (s0, t0) == (0, 0) and lock["lock_wait"] == 0.125 and abs(lock["result_send"] - 10e-6) < 1e-12
    assert (s1, t1) == (1, 0) and phases["submit"] == 0.25 and phases["synchronize"] == 0.5
    assert abs(phases["pre_decode"] - 10e-6) < 1e-12 and abs(phases["post_decode"] - 30e-6) < 1e-12
    assert (s2, t2) == (0, 3) and per_token["detokenize"] == 3e-6 and per_token["stop_strings"] == 4e-6
    assert abs(per_token["sampling"] - (10e-6 - 3e-6)) < 1e-12  # the masks' share is reported apart


def test_an_iteration_without_a_step_is_not_logged_as_one(monkeypatch):
    monkeypatch.setattr(step_probe, "_now", _Clock())
    events = []
    monkeypatch.setattr(trace, "enabled", True)
    monkeypatch.setattr(trace, "event", lambda c, n, t0, t1, **f: events.append(n))
    probe = step_probe.StepProbe(0)
    probe.begin()  # (commands only: nothing built)
    probe.sending()
    probe.end(lock_wait_s=0.0)
    assert events == ["result_send"] and not probe.steps.steps
    _step(probe, sampled=False)  # an embedding step samples nothing
    assert "sampling" not in events and events[-1] == "iteration" and len(probe.steps.steps) == 1


def test_untraced_steps_write_no_events(monkeypatch):
    monkeypatch.setattr(trace, "enabled", False)
    monkeypatch.setattr(trace, "event", lambda *a, **k: (_ for _ in ()).throw(AssertionError("traced")))
    probe = step_probe.StepProbe(0)
    _step(probe)
    assert len(probe.steps.steps) == 1
