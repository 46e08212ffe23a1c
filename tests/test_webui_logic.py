"""The chat page's logic without a browser: `pyllama/server/webui/chatlogic.js` run by node (the
pure functions that build request bodies, apply --ui-config settings, fold streamed deltas into a
reply, edit and regenerate conversations, read attachments and export them), and a real server
that serves the page's scripts and hands the page its --ui-config settings through /props, the
body the page builds from them being one the server accepts.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from server_util import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
WEBUI = ROOT / "pyllama" / "server" / "webui"
LOGIC = WEBUI / "chatlogic.js"
NODE = shutil.which("node")

need_node = pytest.mark.skipif(NODE is None, reason="needs node (Node.js) to run the page's JavaScript")

# what an administrator could pass to --ui-config: keys the page honours, one it does not know
# (llama.cpp's MCP servers), and values of the wrong type, all of which must be skipped silently
UI_SETTINGS = {"systemMessage": "Answer in French.", "temperature": 0.2, "top_k": "7", "typ_p": 0.9,
               "samplers": "top_k;typ_p;top_p;min_p;temperature", "max_tokens": 0, "repeat_penalty": 1.1,
               "showThoughtInProgress": True, "theme": "dark", "sendOnEnter": False,
               "mcpServers": [{"url": "http://example.org"}], "top_p": "high", "showMessageStats": "yes"}


def js(expr: str, **values: Any) -> Any:
    """Evaluates `expr` under node with `L` the page's logic module and `V` the given values;
    returns its JSON result. An exception in the expression fails the call with its message."""
    script = ("const L = require(process.argv[1]);"
              "let raw = ''; process.stdin.on('data', (d) => raw += d); process.stdin.on('end', () => {"
              "const V = JSON.parse(raw); const out = (() => (" + expr + "))();"
              "process.stdout.write(JSON.stringify(out === undefined ? null : out)); });")
    proc = subprocess.run([NODE, "-e", script, str(LOGIC)], input=json.dumps(values), capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        raise JSError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"node exited {proc.returncode}")
    return json.loads(proc.stdout)


class JSError(Exception):
    pass


def js_error(expr: str, **values: Any) -> str:
    """The message of the error `expr` throws (the test fails if it throws none)."""
    return js("(() => { try { " + expr + "; } catch (e) { return e.message; } return null; })()", **values) or \
        pytest.fail(f"{expr} threw nothing")


# --- settings ------------------------------------------------------------------------------------
@need_node
def test_ui_settings_apply_the_keys_the_page_has_and_skip_the_rest():
    out = js("L.applyUiSettings(L.defaults(), V.ui)", ui=UI_SETTINGS)
    s = out["settings"]
    assert sorted(out["applied"]) == sorted(["systemMessage", "temperature", "top_k", "typ_p", "samplers", "max_tokens",
                                             "repeat_penalty", "showThoughtInProgress", "theme", "sendOnEnter"])
    # unknown keys and values of the wrong type: skipped, the page's defaults kept
    assert sorted(out["ignored"]) == ["mcpServers", "showMessageStats", "top_p"]
    assert "mcpServers" not in s
    assert (s["top_p"], s["showMessageStats"]) == (0.95, True)
    assert (s["systemMessage"], s["temperature"], s["top_k"], s["theme"]) == ("Answer in French.", 0.2, 7, "dark")
    assert s["showThoughtInProgress"] is True and s["sendOnEnter"] is False
    # nothing but an object is read; the page's defaults stay
    for given in (None, [1, 2], "dark", 3):
        assert js("L.applyUiSettings(L.defaults(), V.g)", g=given) == {"settings": js("L.defaults()"), "applied": [],
                                                                      "ignored": []}


@need_node
def test_the_users_own_settings_sit_over_the_servers():
    s = js("L.effectiveSettings(V.ui, V.user)", ui=UI_SETTINGS, user={"temperature": "0.7", "theme": "light", "seed": 3})
    assert (s["temperature"], s["theme"], s["seed"]) == (0.7, "light", 3)  # the user's
    assert (s["systemMessage"], s["top_k"]) == ("Answer in French.", 7)  # the server's
    assert s["min_p"] == 0.05  # the page's
    assert js("L.effectiveSettings({}, {})") == js("L.defaults()")


@need_node
def test_request_body_carries_the_settings():
    body = js("L.buildRequestBody(V.msgs, L.effectiveSettings(V.ui, {}))", ui=UI_SETTINGS,
              msgs=[{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Salut", "reasoning": "greet", "state": "done",
                     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "user", "content": "Again"}])
    assert body["messages"] == [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Salut"}, {"role": "user", "content": "Again"}]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    # typ_p travels as typical_p (the field servers read), samplers as a list, max_tokens 0 as no limit
    assert body["typical_p"] == 0.9 and "typ_p" not in body
    assert body["samplers"] == ["top_k", "typ_p", "top_p", "min_p", "temperature"]
    assert (body["temperature"], body["top_k"], body["max_tokens"], body["repeat_penalty"]) == (0.2, 7, -1, 1.1)
    # a setting left empty is not sent: the server's default applies
    for field in ("dry_multiplier", "xtc_probability", "presence_penalty", "reasoning_format"):
        assert field not in body
    assert js("L.buildRequestBody([], L.effectiveSettings({}, {systemMessage: '  '}))")["messages"] == []
    # a field the user emptied: that field is not sent, whatever the default under it
    body = js("L.buildRequestBody([], L.effectiveSettings(V.ui, {temperature: '', top_k: ''}))", ui=UI_SETTINGS)
    assert "temperature" not in body and "top_k" not in body and body["min_p"] == 0.05


@need_node
def test_request_body_reasoning_format_and_custom_fields():
    body = js("L.buildRequestBody([{role: 'user', content: 'x'}], L.effectiveSettings({}, V.s))",
              s={"disableReasoningParsing": True, "custom": '{"tool_choice": "required", "temperature": 1.5}'})
    assert body["reasoning_format"] == "none"
    assert body["tool_choice"] == "required" and body["temperature"] == 1.5  # custom JSON wins
    # custom given as an object by --ui-config: kept as its JSON text
    assert js("L.effectiveSettings({custom: {n_probs: 2}}, {}).custom") == '{"n_probs":2}'
    assert "custom JSON does not parse" in js_error("L.buildRequestBody([], L.effectiveSettings({}, {custom: '{bad'}))")
    assert "must be an object" in js_error("L.buildRequestBody([], L.effectiveSettings({}, {custom: '[1]'}))")
    assert "temperature must be a number" in js_error("L.requestParams(Object.assign(L.defaults(), {temperature: 'x'}))")


# --- the streamed reply ----------------------------------------------------------------------------
def chunk(delta: dict, finish: str | None = None, **extra: Any) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


@need_node
def test_deltas_accumulate_reasoning_content_and_tool_calls():
    chunks = [chunk({"role": "assistant", "content": None}),
              chunk({"reasoning_content": "Let me "}), chunk({"reasoning_content": "think."}),
              chunk({"content": "Calling."}),
              chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                     "function": {"name": "get_time", "arguments": "{}"}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
              chunk({}, "tool_calls"),
              {"choices": [], "timings": {"predicted_n": 9, "predicted_per_second": 12.5}}]
    out = js("(() => { const r = L.newReply(); const changed = V.chunks.map((c) => L.applyChunk(r, c));"
             " return {r, changed}; })()", chunks=chunks)
    r = out["r"]
    assert out["changed"] == [False, True, True, True, True, True, True, True, False, False]
    assert r["reasoning"] == "Let me think." and r["content"] == "Calling."
    assert r["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    assert r["finish_reason"] == "tool_calls" and r["timings"]["predicted_n"] == 9
    assert js("L.statsLine(V.t)", t=r["timings"]) == "9 tokens, 12.5 tokens/s"
    # arguments drawn as they stream (raw) and indented once they parse
    assert js("L.formatArguments('{\"city\": ')") == '{"city": '
    assert js("L.formatArguments('{\"city\":\"Paris\"}')") == '{\n  "city": "Paris"\n}'
    assert js_error("L.applyChunk(L.newReply(), {error: {message: 'the context is full'}})") == "the context is full"


@need_node
def test_server_sent_events_are_cut_at_event_ends():
    out = js("L.splitEvents(V.buf)", buf='data: {"a":1}\n\ndata: [DONE]\r\n\r\ndata: {"b"')
    assert out == {"datas": ['{"a":1}', "[DONE]"], "rest": 'data: {"b"'}
    assert js("L.splitEvents(V.buf)", buf=out["rest"] + ':2}\n\n') == {"datas": ['{"b":2}'], "rest": ""}


# --- conversation edits -----------------------------------------------------------------------------
CONV = {"id": "c1", "title": "First", "created": 5, "messages": [
    {"role": "user", "content": "First"}, {"role": "assistant", "content": "A1", "reasoning": "", "state": "done"},
    {"role": "user", "content": "Second", "attachments": [{"name": "n.txt", "size": 3, "text": "abc"}]},
    {"role": "assistant", "content": "A2", "reasoning": "r", "state": "done"}]}


@need_node
def test_editing_a_user_message_drops_what_followed_it():
    out = js("(() => { const e = L.editMessage(V.c, 2, 'Second, edited'); return {e, c: V.c}; })()", c=CONV)
    assert [m["content"] for m in out["e"]["messages"]] == ["First", "A1", "Second, edited"]
    assert out["e"]["messages"][2]["attachments"] == CONV["messages"][2]["attachments"]  # kept
    assert out["c"] == CONV  # the original is untouched
    assert js("L.editMessage(V.c, 0, 'New start').title", c=CONV) == "New start"
    assert js_error("L.editMessage(V.c, 1, 'x')", c=CONV) == "only a user message can be edited"


@need_node
def test_regenerating_a_reply_drops_it_and_what_followed():
    assert [m["content"] for m in js("L.regenerateAt(V.c, 3).messages", c=CONV)] == ["First", "A1", "Second"]
    assert [m["content"] for m in js("L.regenerateAt(V.c, 1).messages", c=CONV)] == ["First"]
    assert js("L.lastAssistantIndex(V.c)", c=CONV) == 3
    assert js_error("L.regenerateAt(V.c, 2)", c=CONV) == "only an assistant reply can be regenerated"


# --- attachments -------------------------------------------------------------------------------------
@need_node
def test_text_attachments_go_into_the_user_message():
    msg = js("L.apiMessage(V.m)", m=CONV["messages"][2])
    assert msg == {"role": "user", "content": [{"type": "text", "text": "Second"},
                                               {"type": "text", "text": "\n\n--- File: n.txt ---\nabc"}]}
    # a message of attachments only: no empty text part
    assert js("L.apiMessage({role: 'user', content: '', attachments: [{name: 'a', size: 1, text: 'x'}]})") == \
        {"role": "user", "content": [{"type": "text", "text": "\n\n--- File: a ---\nx"}]}


@need_node
def test_attachments_must_be_small_utf8_text():
    ok = js("L.textAttachment('notes.md', new TextEncoder().encode('caf\\u00e9\\n'))")
    assert ok == {"name": "notes.md", "size": 6, "text": "caf\u00e9\n"}
    assert js_error("L.textAttachment('a.png', new Uint8Array([0x89, 0x50, 0x4e, 0x47, 0, 1]))") == \
        "a.png is not a text file (only UTF-8 text can be attached)"
    assert "not a text file" in js_error("L.textAttachment('x.bin', new Uint8Array([0x61, 0xff, 0xfe]))")
    assert js_error("L.textAttachment('big.txt', new Uint8Array(600 * 1024).fill(97))") == \
        "big.txt is too large to attach (600 KiB; the limit is 512 KiB)"
    assert js_error("L.checkAttachmentSize('huge.log', 3 * 1024 * 1024)") == \
        "huge.log is too large to attach (3.0 MiB; the limit is 512 KiB)"
    assert js("L.checkAttachmentSize('ok.txt', 512 * 1024)") is None


# --- export and import ----------------------------------------------------------------------------------
@need_node
def test_export_then_import_gives_the_conversation_back():
    conv = json.loads(json.dumps(CONV))
    conv["messages"][3]["tool_calls"] = [{"id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": '{"x": 1}'}}]
    conv["messages"].append({"role": "user", "content": "Third"})
    conv["messages"].append({"role": "assistant", "content": "half", "reasoning": "", "state": "streaming"})
    doc = js("L.exportConversation(V.c, 0)", c=conv)
    assert doc["format"] == "pyllama.conversation" and doc["version"] == 1 and doc["exported"] == "1970-01-01T00:00:00.000Z"
    msgs = doc["conversation"]["messages"]
    assert msgs[3] == {"role": "assistant", "content": "A2", "reasoning": "r", "tool_calls": conv["messages"][3]["tool_calls"]}
    assert msgs[5] == {"role": "assistant", "content": "half", "state": "stopped"}
    back = js("L.importConversation(JSON.parse(JSON.stringify(V.d)), 'new')", d=doc)
    assert back["id"] == "new" and back["title"] == "First" and back["created"] == 5
    assert [m["content"] for m in back["messages"]] == [m["content"] for m in conv["messages"]]
    assert back["messages"][2]["attachments"] == conv["messages"][2]["attachments"]
    assert back["messages"][3]["tool_calls"] == conv["messages"][3]["tool_calls"]
    assert back["messages"][1]["state"] == "done" and back["messages"][5]["state"] == "stopped"
    # exported again, it is the same document
    assert js("L.exportConversation(L.importConversation(V.d, 'c1'), 0)", d=doc) == doc
    assert js("L.exportFileName({title: 'Où est / le chat?'})") == "O_est_le_chat.json"


@need_node
def test_import_refuses_what_it_cannot_draw():
    assert js_error("L.importConversation({format: 'other', conversation: {}}, 'x')") == 'unknown format "other"'
    assert js_error("L.importConversation([], 'x')") == "not a conversation: no messages list"
    assert js_error("L.importConversation({messages: [{role: 'system', content: 's'}]}, 'x')") == \
        "message 0: role must be user or assistant"
    assert js_error("L.importConversation({messages: [{role: 'user', content: 3}]}, 'x')") == \
        "message 0: content must be a string"
    # a bare conversation is taken; its title comes from the first message
    assert js("L.importConversation({messages: [{role: 'user', content: 'Hello'}]}, 'x').title") == "Hello"


# --- the page's files ---------------------------------------------------------------------------------
@need_node
def test_the_module_is_a_browser_global_too():
    script = ("globalThis.window = {}; require(process.argv[1]);"
              "process.stdout.write(typeof window.ChatLogic.buildRequestBody)")
    out = subprocess.run([NODE, "-e", script, str(LOGIC)], capture_output=True, text=True, timeout=30)
    assert out.stdout == "function", out.stderr


@need_node
def test_every_setting_has_a_field_on_the_page():
    html = (WEBUI / "index.html").read_text()
    ids = set(re.findall(r'id="([^"]+)"', html))
    keys = js("Object.keys(L.SCHEMA)")
    field = {"systemMessage": "system"}
    assert [k for k in keys if field.get(k, k) not in ids] == []


def test_the_page_reads_the_servers_ui_settings():
    """chat.js asks /props for ui_settings and lays the user's settings over them (the browser
    test in test_webui.py checks the effect; this one fails fast where there is no browser)."""
    src = (WEBUI / "chat.js").read_text()
    assert re.search(r'apiFetch\("props"', src)
    assert "p.ui_settings" in src and "L.effectiveSettings(uiSettings, userSettings)" in src
    html = (WEBUI / "index.html").read_text()
    # the logic module loads before the page's script that uses it
    assert html.index('src="webui/chatlogic.js"') < html.index('src="webui/chat.js"')


# --- against a server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ui_server(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "1", "-c", "1024", "--ui-config", json.dumps(UI_SETTINGS)).wait_ready()
    yield srv
    assert srv.stop() == 0


def test_page_and_scripts_are_served(ui_server):
    status, page = ui_server.request("GET", "/")
    assert status == 200 and page == (WEBUI / "index.html").read_text()
    for name in ("chatlogic.js", "chat.js", "common.js", "markdown.js", "style.css"):
        status, text = ui_server.request("GET", "/webui/" + name)
        assert status == 200 and text == (WEBUI / name).read_text(), name


@need_node
def test_props_carry_ui_settings_and_the_page_builds_a_body_the_server_takes(ui_server):
    status, props = ui_server.request("GET", "/props")
    assert status == 200 and props["ui_settings"] == UI_SETTINGS
    body = js("L.buildRequestBody([{role: 'user', content: 'Hello', attachments: [{name: 'a.txt', size: 2, text: 'hi'}]}],"
              " L.effectiveSettings(V.ui, {}))", ui=props["ui_settings"])
    assert body["messages"][0] == {"role": "system", "content": "Answer in French."}
    assert (body["temperature"], body["top_k"], body["typical_p"]) == (0.2, 7, 0.9)
    body["max_tokens"] = 4
    events = ui_server.stream("/v1/chat/completions", body)
    done = [e for e in events if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")]
    assert done and done[-1]["choices"][0]["finish_reason"] == "length", events[-3:]
