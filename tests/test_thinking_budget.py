"""--reasoning, --reasoning-budget and a request's thinking_budget_tokens: a chat reply's thinking
held to a budget of tokens, whose end is then put in place of the sampled tokens."""
from __future__ import annotations

import pytest

from pyllama.util.errors import PyllamaError
from pyllama.server.options import check_args, parse_args, template_kwargs
from pyllama.batching.thinking import ThinkingBudget
from pyllama.server.reasoning import budget_end_text
from server_util import LONG_CONTEXT, ServerProcess
from tool_templates import FAMILY_TEMPLATES

END = [90, 91]  # the end's tokens, written "\n</think>" and "\n\n"
PIECES = {90: "\n</think>", 91: "\n\n"}


def run(budget: ThinkingBudget, sampled: list[int], pieces: dict[int, str]) -> list[int]:
    """The tokens a reply keeps when the model samples `sampled`, one per step."""
    out = []
    for tok in sampled:
        kept = budget.replace(tok)
        budget.observe({**pieces, **PIECES}.get(kept, f"w{kept} "))
        out.append(kept)
    return out


def test_opened_thinking_ends_after_the_budget():
    b = ThinkingBudget(3, END, forced_open=True)
    assert run(b, [1, 2, 3, 4, 5, 6, 7], {}) == [1, 2, 3, 90, 91, 6, 7]
    assert b.spent >= 3 and not b.forcing


def test_zero_ends_it_at_once():
    assert run(ThinkingBudget(0, END, forced_open=True), [1, 2, 3], {}) == [90, 91, 3]


def test_the_reply_opening_its_thinking_counts_from_the_tag():
    pieces = {7: "<think>"}
    assert run(ThinkingBudget(2, END, forced_open=False), [7, 1, 2, 3, 4, 5], pieces) == [7, 1, 2, 90, 91, 5]


def test_thinking_that_ends_within_the_budget_is_left_alone():
    pieces = {8: "</think>"}
    assert run(ThinkingBudget(3, END, forced_open=True), [1, 8, 2, 3, 4, 5], pieces) == [1, 8, 2, 3, 4, 5]
    # a reply that does not think is never cut
    assert run(ThinkingBudget(0, END, forced_open=False), [1, 2, 3], {}) == [1, 2, 3]


def test_end_text_and_flags():
    assert budget_end_text() == "\n</think>\n\n"
    assert budget_end_text("Enough.") == "\nEnough.\n</think>\n\n"
    assert template_kwargs(parse_args("-m M".split())) is None
    assert template_kwargs(parse_args("-m M --reasoning off".split())) is None  # the template's default, below
    given = parse_args(["-m", "M", "--reasoning", "off", "--chat-template-kwargs", '{"enable_thinking": true, "x": 1}'])
    assert template_kwargs(given) == {"enable_thinking": True, "x": 1}
    a = parse_args("-m M --reasoning-budget 0 --reasoning-budget-message Enough.".split())
    assert (a.reasoning_budget, a.reasoning_budget_message) == (0, "Enough.")
    with pytest.raises(PyllamaError, match="--reasoning-budget -2"):
        check_args(parse_args("-m M --reasoning-budget -2".split()))
    with pytest.raises(SystemExit):
        parse_args("-m M --reasoning maybe".split())


# --- a server whose template opens the thinking (DeepSeek R1's) ---------------------------------

@pytest.fixture(scope="module")
def thinking_server(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "deepseek.jinja"
    path.write_text(FAMILY_TEMPLATES["deepseek"])
    server = ServerProcess(tiny_model, "--chat-template-file", str(path), "-c", "1024", "-np", "1",
                           "--reasoning-budget", "0", *LONG_CONTEXT)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def chat(server: ServerProcess, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": "Why?"}], "max_tokens": 12, "seed": 5, "ignore_eos": True,
            "logprobs": True, **fields}
    status, doc = server.post("/v1/chat/completions", body)
    assert status == 200, doc
    return doc["choices"][0]


def test_server_budget_from_request_and_flag(thinking_server):
    end = budget_end_text()
    # a request's budget: three sampled tokens of thinking, then the end put in, then the answer
    raw = chat(thinking_server, thinking_budget_tokens=3, reasoning_format="none")
    sampled = [e["token"] for e in raw["logprobs"]["content"]]  # tokens put in have no probabilities
    thought = "".join(sampled[:3])
    opened = "<think>\n"  # kept in the content, the thinking starts as the prompt opened it
    assert raw["message"]["content"].startswith(opened + thought + end), raw["message"]["content"]
    assert len(sampled) < 12  # the end's tokens count toward max_tokens
    read = chat(thinking_server, thinking_budget_tokens=3)
    # R1's tags have no whitespace of their own: the reasoning keeps the prompt's newline after <think>
    # (llama-server reads the generation prompt with the reply) and the end's newline before </think>,
    # and the content what follows </think>, as is
    assert read["message"].get("reasoning_content") == ("\n" + thought + "\n" if thought.strip() else None)
    assert read["message"]["content"] == raw["message"]["content"][len(opened + thought + "\n</think>"):], raw
    # the server's --reasoning-budget 0: the thinking ends before any token of it
    now = chat(thinking_server, reasoning_format="none")
    assert now["message"]["content"].startswith(opened + end)
    # -1 lifts it: the reply thinks for all its tokens
    free = chat(thinking_server, thinking_budget_tokens=-1, reasoning_format="none")
    assert "</think>" not in free["message"]["content"] and len(free["logprobs"]["content"]) == 12


def test_server_bad_budget_is_400(thinking_server):
    status, doc = thinking_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                "thinking_budget_tokens": "many"})
    assert status == 400 and "'thinking_budget_tokens' must be an integer" in doc["error"]["message"]
    status, doc = thinking_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                "thinking_budget_tokens": -2})
    assert status == 400 and "thinking_budget_tokens" in doc["error"]["message"]


def test_server_reasoning_budget_tokens_and_message(thinking_server):
    """llama-server's own names: reasoning_budget_tokens (over thinking_budget_tokens) and
    reasoning_budget_message, put before the end of a spent budget."""
    def content(**fields) -> tuple[str, list[str]]:
        c = chat(thinking_server, reasoning_format="none", **fields)
        return c["message"]["content"], [e["token"] for e in c["logprobs"]["content"]]
    by_old, sampled = content(thinking_budget_tokens=3)
    assert content(reasoning_budget_tokens=3)[0] == by_old
    assert content(reasoning_budget_tokens=3, thinking_budget_tokens=8)[0] == by_old
    assert "</think>" not in content(reasoning_budget_tokens=-1, thinking_budget_tokens=3)[0]  # -1 lifts it
    told, told_sampled = content(reasoning_budget_tokens=3, reasoning_budget_message="Enough.", max_tokens=40)
    thought = "".join(told_sampled[:3])
    # (with reasoning_format none the content starts as the prompt opened the thinking)
    assert told.startswith("<think>\n" + thought + budget_end_text("Enough.")), told
    status, doc = thinking_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                "reasoning_budget_message": 3})
    assert status == 400 and "'reasoning_budget_message' must be a string" in doc["error"]["message"]


# --- the budget follows the template: only a template that thinks has one -----------------------

@pytest.mark.parametrize("name, thinks, opened", [("qwen3", True, False), ("deepseek", True, True),
                                                  ("hermes", False, False), ("llama3", False, False),
                                                  ("generic", False, False)])
def test_budget_only_under_a_thinking_template(tokenizer, name, thinks, opened):
    """llama-server hands a budget to the sampler only where its chat format has thinking end
    tags: under a content-only template --reasoning-budget and a request's budget do nothing."""
    import types
    from pyllama.server.api import Api
    from pyllama.server.chat import ChatTemplate
    from tool_templates import QWEN3
    source = QWEN3 if name == "qwen3" else FAMILY_TEMPLATES[name]
    api = Api.__new__(Api)
    api.state = types.SimpleNamespace(
        args=types.SimpleNamespace(n_predict=-1, reasoning_format="auto", reasoning_budget=0, n_keep=0),
        tokenizer=tokenizer, slots_per_group=1, chat=ChatTemplate(source), check_prompt_fits=lambda *a: None)
    body = {"messages": [{"role": "user", "content": "Why?"}]}
    for fields in ({}, {"thinking_budget_tokens": 5}):
        p, _, spec = api._chat_input({**body, **fields})
        assert spec.thinks is thinks and spec.forced_open is opened
        want = (5 if fields else 0) if thinks else -1
        assert (p.thinking_budget, p.thinking_open) == (want, opened and thinks)
        assert bool(p.thinking_end) is thinks


def test_enable_thinking_follows_the_template_and_reasoning():
    """llama-server gives the template enable_thinking true where it thinks (unless --reasoning
    off), false where it does not; --chat-template-kwargs and the request's override that."""
    from pyllama.server.chat import ChatTemplate
    from tool_templates import QWEN3
    body = {"messages": [{"role": "user", "content": "Why?"}]}
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking false
    for reasoning in ("auto", "on"):
        assert ChatTemplate(QWEN3, reasoning=reasoning).render_request(body).endswith("<|im_start|>assistant\n")
        assert ChatTemplate(FAMILY_TEMPLATES["hermes"], reasoning=reasoning).render_request(body).endswith(closed)
    assert ChatTemplate(QWEN3, reasoning="off").render_request(body).endswith(closed)
    server_on = ChatTemplate(QWEN3, reasoning="off", kwargs={"enable_thinking": True})
    assert server_on.render_request(body).endswith("<|im_start|>assistant\n")
    assert server_on.render_request({**body, "chat_template_kwargs": {"enable_thinking": False}}).endswith(closed)
