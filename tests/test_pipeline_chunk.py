"""--pipeline-chunk: while another group of a split generates, a group's prompts go in short chunks."""
from __future__ import annotations

import threading

import pytest

from server_util import ServerProcess

PROMPT = "The little cat sat on the mat and looked at the"


def _groups(model: str, n_groups: int = 2):
    from pyllama.runtime.engine import Engine
    from pyllama.batching.group import PipelineGroup
    from pyllama.obs.metrics import Metrics
    from pyllama.batching.slot import Slot

    engine = Engine(model, n_threads=1)
    groups = []
    for g in range(n_groups):
        ctx = engine.new_context(2048, 1, n_batch=2048, n_ubatch=512)
        slot = Slot(g, g, 0, ctx.seq_cap, engine.tokenizer)
        groups.append(PipelineGroup(g, ctx, [slot], engine.tokenizer, Metrics(), on_free=lambda s: None))
    return engine, groups


def _task(prompt: list[int], n_predict: int):
    from pyllama.batching.sampling import SamplingParams
    from pyllama.batching.task import CompletionTask

    return CompletionTask(prompt=prompt, params=SamplingParams(temperature=0), n_predict=n_predict,
                          cache_prompt=False)


def _prompt_steps(group, slot) -> list[int]:
    """Iterates `group` until `slot` has its prompt in; the tokens each step fed."""
    from pyllama.batching.slot import SlotState

    fed, steps = 0, []
    while slot.state is not SlotState.GENERATING:
        group._iteration()
        steps.append(slot.n_past - fed)
        fed = slot.n_past
    return steps


@pytest.mark.parametrize("chunk", [0, 24])
def test_prompt_is_cut_while_a_neighbour_generates(tiny_model, chunk):
    from pyllama.batching.group import share_stages
    from pyllama.batching.slot import SlotState

    engine, (a, b) = _groups(tiny_model)
    share_stages([a, b], chunk)
    b.submit([(b.slots[0], _task(engine.tokenizer.encode(PROMPT), 500))])
    b._iteration()
    assert b.slots[0].state is SlotState.GENERATING and b.generating()
    long_prompt = [300 + i % 200 for i in range(200)]
    a.submit([(a.slots[0], _task(long_prompt, 2))])
    steps = _prompt_steps(a, a.slots[0])
    if chunk:
        assert steps == [24] * (200 // 24) + [200 % 24]
    else:
        assert steps == [200]  # no limit: the whole prompt in one step of up to n_batch
    # the neighbour done, the next prompt goes in whole again
    b._finish(b.slots[0], None)
    assert not b.generating()
    a._finish(a.slots[0], None)
    a.submit([(a.slots[0], _task(long_prompt[::-1], 2))])
    assert _prompt_steps(a, a.slots[0]) == [200]


def test_one_group_is_never_cut(tiny_model):
    from pyllama.batching.group import share_stages

    engine, (a,) = _groups(tiny_model, 1)
    share_stages([a], 24)
    assert a.core.scheduler.neighbours == [] and a.core.scheduler.shared_prompt_chunk == 0


@pytest.mark.parametrize("wtype,quantized", [("f32", False), ("f16", False), ("q8_0", True), ("q4_0", True)])
def test_blocks_quantized(model_factory, wtype, quantized):
    from pyllama.models.model import Model

    assert Model(model_factory("tiny", wtype=wtype)).blocks_quantized() is quantized


@pytest.mark.parametrize("wtype,stages,option,expect", [
    ("q4_0", [True, True], None, 64),     # quantized, every stage a CPU
    ("q4_0", [True, False], None, 0),     # a stage (a GPU) that wants large batches
    ("f32", [True, True], None, 0),       # F32 products want large batches
    ("f32", [True, False], 16, 16),       # the option always wins
    ("q4_0", [True, True], 0, 0),
])
def test_default_chunk(model_factory, wtype, stages, option, expect):
    from types import SimpleNamespace

    from pyllama.backend.cpu import CPUBackend
    from pyllama.models.model import Model
    from pyllama.runtime.placement.chunk import pipeline_chunk

    assert CPUBackend.small_batches_cheap
    backends = [SimpleNamespace(small_batches_cheap=c) for c in stages]
    assert pipeline_chunk(option, Model(model_factory("tiny", wtype=wtype)), backends) == expect


@pytest.mark.parametrize("wtype,args,expect", [
    ("q4_0", [], 64),                           # quantized: cut by default
    ("f32", [], None),                          # F32 products want large batches: not cut by default
    ("f32", ["--pipeline-chunk", "8"], 8),
    ("q4_0", ["--pipeline-chunk", "0"], None),
])
def test_server_default_and_option(model_factory, rpc_peer, wtype, args, expect):
    srv = ServerProcess(model_factory("tiny", wtype=wtype), "-np", "2", "-c", "1024", "--pipeline-groups", "2",
                        "--rpc", rpc_peer.endpoint, "--device", "RPC0,CPU", *args).wait_ready()
    try:  # both groups busy at once: the answers still come whole
        out: list = []
        threads = [threading.Thread(target=lambda: out.append(srv.post(
            "/completion", {"prompt": PROMPT * 8, "n_predict": 16, "ignore_eos": True, "cache_prompt": False})))
            for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [s for s, _ in out] == [200] * 4 and all(r["tokens_predicted"] == 16 for _, r in out)
    finally:
        assert srv.stop() == 0
    lines = [ln for ln in srv.stderr_text.splitlines() if "a step feeds at most" in ln]
    if expect is None:
        assert lines == []
    else:
        assert len(lines) == 1 and f"at most {expect} prompt tokens" in lines[0]


def test_unsplit_groups_are_never_cut(model_factory):
    srv = ServerProcess(model_factory("tiny", wtype="q4_0"), "-np", "2", "-c", "1024", "--pipeline-groups", "2",
                        "--pipeline-chunk", "8").wait_ready()
    assert srv.stop() == 0
    assert "a step feeds at most" not in srv.stderr_text
