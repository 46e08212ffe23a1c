"""Backend sampling: the sampler chain runs as a SAMPLE op on the device of the output layer, local
or remote, and gives exactly what host sampling gives."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pyllama.backend.cpu import CPUBackend
from pyllama.backend.rpc import RPCBackend
from pyllama.runtime.context import Batch
from pyllama.runtime.engine import Engine
from pyllama.rpc.connection import Connection
from pyllama.batching.sampling import BatchSampler, SamplingParams, SequenceSampler
from server_util import RPCServerProcess, ServerProcess

PARAMS = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=11),
          SamplingParams(temperature=0, n_probs=3),
          SamplingParams(temperature=1.2, min_p=0.05, repeat_penalty=1.3, presence_penalty=0.5, seed=7, n_probs=2)]


def run_steps(ctx, on_device: bool, steps: int = 8) -> list:
    """Three sequences with different prompts and chains; returns every step's ids, probs, candidates."""
    bs = BatchSampler(ctx.hparams.n_vocab, 3, 20)
    samplers = [SequenceSampler(p) for p in PARAMS]
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    tokens = sum(prompts, [])
    pos = sum((list(range(len(p))) for p in prompts), [])
    seqs = sum(([i] * len(p) for i, p in enumerate(prompts)), [])
    want = sum(([False] * (len(p) - 1) + [True] for p in prompts), [])
    batch = Batch(np.array(tokens), np.array(pos), np.array(seqs), np.array(want))
    nxt = [len(p) for p in prompts]
    out = []
    for _ in range(steps):
        if on_device:
            o = ctx.decode(batch, bs.pack(samplers), bs.device_spec())
            assert o.sampled is not None and o.logits.shape[0] == 0
            r = bs.unpack(o.sampled)
        else:
            r = bs.sample(ctx.decode(batch).logits, samplers)
        ids = r.ids.tolist()
        out.append((ids, r.probs.tolist(), r.top_ids[:, :3].tolist(), r.top_probs[:, :3].tolist()))
        for s, t in zip(samplers, ids):
            s.accept(t)
        batch = Batch(np.array(ids), np.array(nxt), np.arange(3), np.ones(3, bool))
        nxt = [p + 1 for p in nxt]
    return out


def test_local_device_sampling_equals_host_sampling(tiny_model):
    engine = Engine(tiny_model, n_threads=1)
    host = run_steps(engine.new_context(512, 3), False)
    dev = run_steps(engine.new_context(512, 3), True)
    assert dev == host
    assert run_steps(engine.new_context(512, 3), True) == dev  # seeded: reproducible with itself


def test_remote_output_layer_samples_on_the_peer(tiny_model, rpc_peer):
    conn = Connection(rpc_peer.endpoint)
    try:
        engine = Engine(tiny_model, n_threads=1, backends=[CPUBackend(1), RPCBackend(conn)], tensor_split=[1, 1])
        ctx = engine.new_context(512, 3)
        assert ctx.can_sample_on_device()
        dev = run_steps(ctx, True)
        host = run_steps(engine.new_context(512, 3), False)
        engine.close()
    finally:
        conn.close()
    local = run_steps(Engine(tiny_model, n_threads=1).new_context(512, 3), False)
    assert dev == host == local


def test_peer_without_the_capability(tiny_model):
    p = RPCServerProcess(env={"PYLLAMA_RPC_SERVER_CAPS": "3"})  # GET_TENSORS and TRACE_SYNC only
    conn = Connection(p.endpoint)
    try:
        engine = Engine(tiny_model, n_threads=1, backends=[CPUBackend(1), RPCBackend(conn)], tensor_split=[1, 1])
        ctx = engine.new_context(512, 3)
        assert not ctx.can_sample_on_device()
        engine.close()
    finally:
        conn.close()
        assert p.stop() == 0


def completions(srv: ServerProcess, seeded: bool = False) -> list:
    out = []
    for i, prompt in enumerate(["The little cat sat on the", "Once upon a time", "1 2 3 4"]):
        # post-sampling probabilities come from the sampler kernel, on the device with backend sampling
        # (pre-sampling ones, the default, are the host logits' softmax: such a step takes the logits back)
        body = {"prompt": prompt, "n_predict": 12, "ignore_eos": True, "cache_prompt": False, "n_probs": 2,
                "return_tokens": True, "post_sampling_probs": True}
        body.update({"temperature": 0.8, "seed": 100 + i} if seeded else {"temperature": 0})
        status, doc = srv.post("/completion", body)
        assert status == 200, doc
        out.append((doc["content"], [(p["id"], p["prob"], [(c["id"], c["prob"]) for c in p["top_probs"]])
                                     for p in doc["completion_probabilities"]]))
    return out


@pytest.mark.parametrize("order", ["CPU,RPC0", "RPC0,CPU"])
@pytest.mark.parametrize("groups", [1, 2])
def test_server_output_identical_with_backend_sampling(tiny_model, rpc_peer, order, groups, tmp_path):
    common = ["--rpc", rpc_peer.endpoint, "--device", order, "-np", "2", "-c", "512", "--pipeline-groups", str(groups)]
    results, reads = {}, {}
    arms = {False: ["--no-backend-sampling"], True: ["--backend-sampling"]}
    if order == "CPU,RPC0":
        arms[None] = []  # the default with the output layer on a peer
    for arm, flag in arms.items():
        trace_path = tmp_path / f"server-{arm}.jsonl"
        srv = ServerProcess(tiny_model, *common, *flag, "--trace", str(trace_path)).wait_ready()
        try:
            results[arm] = (completions(srv), completions(srv, seeded=True), completions(srv, seeded=True))
        finally:
            srv.stop()
        events = [json.loads(x) for x in trace_path.read_text().splitlines()[1:]]
        # a step's reads: not the prompt cache's copies of the KV rows of a prompt a slot gave up
        reads[arm] = [e["subj"] for e in events if e["c"] == "rpc.client" and e["n"].startswith("GET_TENSOR")
                      and not all(name.startswith("cache_") for name in e["subj"].split(","))]
    host, dev = results[False], results[True]
    if order == "CPU,RPC0":  # the output layer is on the peer: ids come back, never the logits
        for arm in (True, None):
            assert reads[arm] and all("result_sampled" in r for r in reads[arm]), (arm, reads[arm][:3])
            assert not any("result_output" in r for r in reads[arm])
        assert any("result_output" in r for r in reads[False]), "--no-backend-sampling still sampled on the peer"
        assert results[None] == dev
    assert dev[0] == host[0], "greedy text or probabilities differ with backend sampling"
    assert dev[1] == dev[2], "a seeded run is not reproducible with backend sampling"
    assert dev[1] == host[1], "seeded sampling differs between the host and the device"


def test_logit_bias_with_the_output_layer_on_the_peer(tiny_model, rpc_peer):
    """A step holding a biased row takes the logits back and samples here; results equal host sampling."""
    common = ["--rpc", rpc_peer.endpoint, "--device", "CPU,RPC0", "-np", "2", "-c", "512"]
    body = {"prompt": "Once upon a time", "n_predict": 8, "ignore_eos": True, "cache_prompt": False,
            "temperature": 0, "return_tokens": True}
    got = {}
    for flag in ("--backend-sampling", "--no-backend-sampling"):
        srv = ServerProcess(tiny_model, *common, flag).wait_ready()
        try:
            status, plain = srv.post("/completion", body)
            assert status == 200, plain
            status, banned = srv.post("/completion", {**body, "logit_bias": [[plain["tokens"][0], False]]})
            assert status == 200, banned
            got[flag] = (plain["tokens"], banned["tokens"])
        finally:
            srv.stop()
    assert got["--backend-sampling"] == got["--no-backend-sampling"]
    plain, banned = got["--backend-sampling"]
    assert plain[0] not in banned
