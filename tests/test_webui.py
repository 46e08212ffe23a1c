"""The built-in pages in a real headless browser (Debian's chromium and chromium-driver, through
Selenium): the chat page at / against a real server, feature by feature, and the pipeline view of a
real RPC0,CPU split checked against what trace_tools/merge.py computes from a trace of the same run.
The chat page's logic without a browser is tested by test_webui_logic.py.

With PYLLAMA_SCREENSHOTS=DIR the tests save the screenshots shown in docs/server.md there
(`PYLLAMA_SCREENSHOTS=docs python -m pytest tests/test_webui.py`).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from server_util import LONG_CONTEXT, RPCServerProcess, ServerProcess

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
    HAVE_SELENIUM = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_SELENIUM = False

pytestmark = pytest.mark.skipif(
    not (HAVE_SELENIUM and CHROMIUM and DRIVER),
    reason="needs selenium (pip install selenium) and Debian's chromium and chromium-driver "
           "(apt-get install chromium chromium-driver)")

SHOTS = os.environ.get("PYLLAMA_SCREENSHOTS")
KEY = "webui-test-key-0123456789"
# a template that thinks (it shows an earlier reply's reasoning_content between think tags) and
# whose generation prompt opens a think tag: everything the model writes is reasoning
THINK_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>"
                  "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n{% endif %}"
                  "{{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")


# a template with a Hermes tool-call format: with tool_choice required the server's grammar makes
# even the tiny random model write a call
TOOL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if tools %}<tools>{{ tools | tojson }}</tools> answer with <tool_call>{% endif %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"enum": ["paris", "oslo"]}}}}}
# --ui-config: settings the page honours, and keys of llama.cpp's page it has no feature for
UI_CONFIG = {"systemMessage": "Be brief.", "temperature": 0, "top_k": 5, "max_tokens": 12, "seed": 3,
             "theme": "dark", "showThoughtInProgress": True, "mcpServers": [], "pyInterpreterEnabled": True}


@pytest.fixture(scope="module")
def browser():
    # chromium leaves a directory for its singleton socket in TMPDIR when it quits: give it one
    # of its own and remove that
    tmp = tempfile.mkdtemp(prefix="pyllama-chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,860", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-default-apps", "--disable-sync"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER, env={**os.environ, "TMPDIR": tmp}), options=opts)
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def chat_server(tiny_model):
    # --ignore-eos: a reply runs to its max_tokens (the stop test needs a long one)
    srv = ServerProcess(tiny_model, "-np", "2", "-c", "8192", "--ignore-eos", *LONG_CONTEXT).wait_ready()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def key_server(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "1", "-c", "1024", "--api-key", KEY,
                        "--chat-template", THINK_TEMPLATE).wait_ready()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def tool_server(tiny_model):
    srv = ServerProcess(tiny_model, "-np", "1", "-c", "2048", "--jinja", "--chat-template", TOOL_TEMPLATE,
                        "--ui-config", json.dumps(UI_CONFIG)).wait_ready()
    yield srv
    assert srv.stop() == 0


# --- helpers ------------------------------------------------------------------------------------
def wait(driver, cond, timeout: float = 15):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: cond(d))


def fresh(driver, url: str) -> None:
    """Opens url with this origin's storage emptied and the logs drained."""
    driver.get(url)
    driver.execute_script("localStorage.clear()")
    driver.get(url)
    driver.get_log("browser")
    driver.get_log("performance")


def console_errors(driver, allow: tuple[str, ...] = ()) -> list[str]:
    return [e["message"] for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allow)]


def requests_seen(driver) -> list[str]:
    """Every URL the pages asked for since the last call (the DevTools network log)."""
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def assert_local_only(urls: list[str], srv: ServerProcess) -> None:
    here = urlsplit(srv.url)
    for u in urls:
        p = urlsplit(u)
        assert p.scheme == "data" or (p.scheme, p.netloc) == (here.scheme, here.netloc), f"request left the host: {u}"


def set_field(driver, field_id: str, value: str) -> None:
    el = driver.find_element(By.ID, field_id)
    el.clear()
    el.send_keys(value)


def send_message(driver, text: str) -> None:
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()


def last_reply(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def stored_reply(driver) -> dict:
    convs = json.loads(driver.execute_script("return localStorage.getItem('pyllama.conversations')"))
    return convs[-1]["messages"][-1]


def chat_bodies(driver) -> list[dict]:
    """The bodies the page POSTed to /v1/chat/completions since the logs were last drained."""
    bodies = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            req = msg["params"]["request"]
            if req["url"].endswith("/v1/chat/completions") and req.get("postData"):
                bodies.append(json.loads(req["postData"]))
    return bodies


def ready(driver) -> None:
    wait(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")


def messages(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .msg")


def stored_conversation(driver) -> dict:
    return json.loads(driver.execute_script("return localStorage.getItem('pyllama.conversations')"))[-1]


def wait_reply_done(driver, n_messages: int) -> None:
    wait(driver, lambda d: len(messages(d)) == n_messages and last_reply(d).get_attribute("data-state") == "done")


def choose_files(driver, input_id: str, *paths: Path) -> None:
    field = driver.find_element(By.ID, input_id)
    driver.execute_script("arguments[0].hidden = false", field)  # a hidden input takes no keys
    field.send_keys("\n".join(str(p) for p in paths))
    driver.execute_script("arguments[0].hidden = true", field)


def direct_reply(srv: ServerProcess, body: dict) -> dict:
    """The message the API answers for the body the page sent, asked without streaming."""
    status, res = srv.post("/v1/chat/completions", {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert status == 200, res
    return res["choices"][0]["message"]


def shot(driver, name: str, height: int = 860) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        driver.set_window_size(1280, height)
        driver.save_screenshot(str(Path(SHOTS) / name))
        driver.set_window_size(1280, 860)


# --- the chat page ------------------------------------------------------------------------------
def test_chat_streams_the_reply_of_the_api(browser, chat_server):
    srv = chat_server
    fresh(browser, srv.url + "/")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    for field, value in (("temperature", "0"), ("max_tokens", "24"), ("seed", "7"), ("system", "Be brief.")):
        set_field(browser, field, value)
    send_message(browser, "Hello there")
    wait(browser, lambda d: last_reply(d).get_attribute("data-state") == "done")
    reply = last_reply(browser)
    assert int(reply.get_attribute("data-chunks")) > 1  # it came in pieces, as they were generated
    status, want = srv.post("/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        "temperature": 0, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "max_tokens": 24, "seed": 7})
    assert status == 200, want
    assert want["usage"]["completion_tokens"] == 24
    got = stored_reply(browser)
    assert got["content"] == want["choices"][0]["message"]["content"]
    assert got["content"] and got["state"] == "done"
    # the conversation survives a reload (localStorage) and is drawn again
    browser.refresh()
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg")) == 2
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0"
    assert console_errors(browser) == []
    assert_local_only(requests_seen(browser), srv)


def test_chat_markdown_rendering_is_safe(browser, chat_server):
    srv = chat_server
    fresh(browser, srv.url + "/")
    text = ("## Result\n\nSome **bold**, *italic* and `code`, a [link](https://example.org/x).\n\n"
            "```python\nprint('<b>1</b>')\n```\n\n- one\n- two\n\n<img src=x onerror=alert(1)><script>bad()</script>")
    conv = [{"id": "c1", "title": "md", "created": 0,
             "messages": [{"role": "user", "content": "show markdown"},
                          {"role": "assistant", "content": text, "reasoning": "first I thought", "state": "done"}]}]
    browser.execute_script("localStorage.setItem('pyllama.conversations', arguments[0]);"
                           "localStorage.setItem('pyllama.current', 'c1')", json.dumps(conv))
    browser.refresh()
    reply = wait(browser, lambda d: last_reply(d))
    content = reply.find_element(By.CLASS_NAME, "content")
    assert content.find_element(By.TAG_NAME, "h4").text == "Result"
    assert content.find_element(By.TAG_NAME, "strong").text == "bold"
    assert content.find_element(By.TAG_NAME, "em").text == "italic"
    code = content.find_element(By.CSS_SELECTOR, "pre code.language-python")
    assert code.get_attribute("textContent") == "print('<b>1</b>')"
    link = content.find_element(By.TAG_NAME, "a")
    assert link.get_attribute("href") == "https://example.org/x" and "noopener" in link.get_attribute("rel")
    assert [li.text for li in content.find_elements(By.TAG_NAME, "li")] == ["one", "two"]
    # markup in the text stays text
    assert content.find_elements(By.TAG_NAME, "img") == [] and content.find_elements(By.TAG_NAME, "script") == []
    assert "<script>bad()</script>" in content.text
    details = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert details.get_attribute("open") is None
    assert not reply.find_element(By.CLASS_NAME, "reasoning-text").is_displayed()
    details.find_element(By.TAG_NAME, "summary").click()
    assert reply.find_element(By.CLASS_NAME, "reasoning-text").text == "first I thought"
    shot(browser, "webui-chat.png")
    assert console_errors(browser) == []
    assert_local_only(requests_seen(browser), srv)


def test_chat_stop_ends_the_generation(browser, chat_server):
    srv = chat_server
    fresh(browser, srv.url + "/")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "8000")
    send_message(browser, "Tell me everything")
    wait(browser, lambda d: int(last_reply(d).get_attribute("data-chunks") or 0) >= 3)
    # a reply longer than the window scrolls inside the messages pane: the page itself keeps its
    # height, so the composer (and Stop) stays where it is while the text grows
    wait(browser, lambda d: d.execute_script(
        "const m = document.getElementById('messages'); return m.scrollHeight > 2 * m.clientHeight"))
    assert browser.execute_script(
        "return document.documentElement.scrollHeight <= window.innerHeight") is True
    box = browser.execute_script("return document.getElementById('stop').getBoundingClientRect().bottom")
    assert box <= browser.execute_script("return window.innerHeight")
    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda d: last_reply(d).get_attribute("data-state") == "stopped")
    # the server cancels the request: its slot is free again, far short of 8000 tokens
    deadline = time.monotonic() + 10
    while True:
        _, slots = srv.request("GET", "/slots")
        if not any(s["is_processing"] for s in slots):
            break
        assert time.monotonic() < deadline, slots
        time.sleep(0.05)
    assert int(last_reply(browser).get_attribute("data-chunks")) < 4000  # far from the end of the slot's context
    n = len(stored_reply(browser)["content"])
    time.sleep(0.3)
    assert len(stored_reply(browser)["content"]) == n
    assert browser.find_element(By.ID, "send").is_enabled()
    assert not browser.find_element(By.ID, "stop").is_enabled()
    assert console_errors(browser) == []


def test_api_key_prompt_and_reasoning(browser, key_server):
    srv = key_server
    fresh(browser, srv.url + "/")
    dialog = browser.find_element(By.ID, "key-dialog")
    wait(browser, lambda d: dialog.is_displayed())
    browser.find_element(By.ID, "api-key").send_keys("wrong-key")
    browser.find_element(By.ID, "key-save").click()
    # refused: asked again, saying why
    wait(browser, lambda d: "Invalid API Key" in d.find_element(By.ID, "key-error").text)
    assert dialog.is_displayed()
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    assert not dialog.is_displayed()
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "16")
    send_message(browser, "Think first")
    wait(browser, lambda d: last_reply(d).get_attribute("data-state") == "done")
    status, want = srv.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Think first"}], "temperature": 0, "top_k": 40, "top_p": 0.95,
        "min_p": 0.05, "max_tokens": 16, "seed": -1}, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, want
    msg = want["choices"][0]["message"]
    assert msg.get("reasoning_content")  # the template opened <think>: the reply is all reasoning
    got = stored_reply(browser)
    assert got["reasoning"] == msg["reasoning_content"] and got["content"] == (msg["content"] or "")
    reply = last_reply(browser)
    assert reply.find_element(By.CSS_SELECTOR, "details.reasoning").get_attribute("open") is None
    assert not reply.find_element(By.CLASS_NAME, "reasoning-text").is_displayed()
    # the refused key and the first unauthenticated call are the only errors
    assert console_errors(browser, allow=("401",)) == []
    assert_local_only(requests_seen(browser), srv)


def test_edit_a_message_and_regenerate_a_reply(browser, chat_server):
    srv = chat_server
    fresh(browser, srv.url + "/")
    ready(browser)
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "8")
    send_message(browser, "Hello")
    wait_reply_done(browser, 2)
    send_message(browser, "Second question")
    wait_reply_done(browser, 4)
    chat_bodies(browser)
    # edit the first message: what followed it goes, a new reply to the edited text comes
    messages(browser)[0].find_element(By.CSS_SELECTOR, "button.edit").click()
    area = messages(browser)[0].find_element(By.CSS_SELECTOR, "textarea.edit-input")
    assert area.get_attribute("value") == "Hello"
    area.clear()
    area.send_keys("Changed")
    messages(browser)[0].find_element(By.CSS_SELECTOR, "button.save-edit").click()
    wait_reply_done(browser, 2)
    [body] = chat_bodies(browser)
    assert body["messages"] == [{"role": "user", "content": "Changed"}]
    conv = stored_conversation(browser)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][0]["content"] == "Changed" and conv["title"] == "Changed"
    first = conv["messages"][1]["content"]
    assert first == direct_reply(srv, body)["content"]
    # regenerate the last reply: asked again with the same messages, the reply replaced (the
    # click's handler swaps in the new streaming reply before it returns)
    last_reply(browser).find_element(By.CSS_SELECTOR, "button.regenerate").click()
    wait_reply_done(browser, 2)
    [again] = chat_bodies(browser)
    assert again["messages"] == [{"role": "user", "content": "Changed"}]
    conv = stored_conversation(browser)
    assert len(conv["messages"]) == 2 and conv["messages"][1]["content"] == first  # greedy: the same text
    assert console_errors(browser) == []


def test_attach_a_text_file(browser, chat_server, tmp_path):
    srv = chat_server
    fresh(browser, srv.url + "/")
    ready(browser)
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "6")
    notes = tmp_path / "notes.txt"
    notes.write_text("The secret word is swordfish.\n")
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    big = tmp_path / "big.log"
    big.write_bytes(b"x" * (600 * 1024))
    choose_files(browser, "file", binary)
    wait(browser, lambda d: "image.png is not a text file" in d.find_element(By.ID, "status").text)
    choose_files(browser, "file", big)
    wait(browser, lambda d: "big.log is too large to attach" in d.find_element(By.ID, "status").text)
    choose_files(browser, "file", notes)
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#pending .attachment"))
    assert [a.get_attribute("data-name") for a in browser.find_elements(By.CSS_SELECTOR, "#pending .attachment")] == \
        ["notes.txt"]  # the refused files are not attached
    chat_bodies(browser)
    send_message(browser, "What is the secret word?")
    wait_reply_done(browser, 2)
    [body] = chat_bodies(browser)
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What is the secret word?"},
        {"type": "text", "text": "\n\n--- File: notes.txt ---\nThe secret word is swordfish.\n"}]}]
    assert browser.find_elements(By.CSS_SELECTOR, "#pending .attachment") == []
    user = messages(browser)[0]
    assert user.find_element(By.CSS_SELECTOR, ".attachments .attachment").get_attribute("data-name") == "notes.txt"
    conv = stored_conversation(browser)
    assert conv["messages"][0]["attachments"] == [{"name": "notes.txt", "size": 30,
                                                   "text": "The secret word is swordfish.\n"}]
    assert conv["messages"][1]["content"] == direct_reply(srv, body)["content"]
    assert console_errors(browser) == []


def test_ui_config_settings_reach_the_page_and_its_requests(browser, tool_server):
    srv = tool_server
    fresh(browser, srv.url + "/")
    ready(browser)
    assert browser.find_element(By.ID, "system").get_attribute("value") == "Be brief."
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0"
    assert browser.find_element(By.ID, "max_tokens").get_attribute("value") == "12"
    assert browser.find_element(By.ID, "showThoughtInProgress").is_selected()
    assert browser.execute_script("return document.documentElement.dataset.theme") == "dark"
    applied = browser.find_element(By.TAG_NAME, "body").get_attribute("data-ui-applied").split(",")
    assert sorted(applied) == sorted(["systemMessage", "temperature", "top_k", "max_tokens", "seed", "theme",
                                      "showThoughtInProgress"])  # mcpServers, pyInterpreterEnabled: no feature here
    send_message(browser, "Hello")
    wait_reply_done(browser, 2)
    [body] = chat_bodies(browser)
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert (body["temperature"], body["top_k"], body["max_tokens"], body["seed"]) == (0, 5, 12, 3)
    assert "mcpServers" not in body and "pyInterpreterEnabled" not in body
    assert stored_reply(browser)["content"] == direct_reply(srv, body)["content"]
    # what the user changes wins over the server's settings, in this browser, until Defaults
    set_field(browser, "temperature", "0.5")
    browser.find_element(By.ID, "input").click()  # the field's change event
    browser.refresh()
    ready(browser)
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0.5"
    assert browser.find_element(By.ID, "system").get_attribute("value") == "Be brief."
    browser.find_element(By.ID, "reset-settings").click()
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0"
    assert console_errors(browser) == []
    assert_local_only(requests_seen(browser), srv)


def test_tool_calls_are_shown_as_they_stream(browser, tool_server):
    srv = tool_server
    fresh(browser, srv.url + "/")
    ready(browser)
    browser.find_element(By.CSS_SELECTOR, "details.more summary").click()  # "More samplers"
    set_field(browser, "custom", json.dumps({"tools": [WEATHER], "tool_choice": "required",
                                             "parallel_tool_calls": False}))
    set_field(browser, "max_tokens", "300")  # room for the whole call (the grammar allows spaces)
    chat_bodies(browser)
    send_message(browser, "Weather in Paris?")
    wait_reply_done(browser, 2)
    [body] = chat_bodies(browser)
    assert body["tools"] == [WEATHER] and body["tool_choice"] == "required"
    reply = last_reply(browser)
    assert int(reply.get_attribute("data-chunks")) > 3  # the arguments came in pieces
    [call] = reply.find_elements(By.CSS_SELECTOR, ".tool-call")
    assert call.find_element(By.CLASS_NAME, "tool-name").text == "get_weather"
    shown = json.loads(call.find_element(By.CLASS_NAME, "tool-args").text)
    want = direct_reply(srv, body)["tool_calls"][0]["function"]
    assert want["name"] == "get_weather" and shown == json.loads(want["arguments"])
    stored = stored_reply(browser)["tool_calls"]
    assert [c["function"]["name"] for c in stored] == ["get_weather"]
    assert json.loads(stored[0]["function"]["arguments"]) == shown and stored[0]["id"].startswith("call_")
    assert stored_reply(browser)["finish_reason"] == "tool_calls"
    assert console_errors(browser) == []


def test_export_and_import_a_conversation(browser, chat_server, tmp_path):
    srv = chat_server
    fresh(browser, srv.url + "/")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"oslo"}'}}
    conv = [{"id": "c1", "title": "Weather", "created": 7, "messages": [
        {"role": "user", "content": "Weather?", "attachments": [{"name": "a.txt", "size": 2, "text": "hi"}]},
        {"role": "assistant", "content": "Let me look.", "reasoning": "a tool knows", "tool_calls": [call],
         "state": "done"}]}]
    browser.execute_script("localStorage.setItem('pyllama.conversations', arguments[0]);"
                           "localStorage.setItem('pyllama.current', 'c1')", json.dumps(conv))
    browser.refresh()
    ready(browser)
    reply = last_reply(browser)
    assert reply.find_element(By.CLASS_NAME, "tool-name").text == "get_weather"
    assert json.loads(reply.find_element(By.CLASS_NAME, "tool-args").text) == {"city": "oslo"}
    assert reply.find_element(By.CSS_SELECTOR, "details.reasoning").get_attribute("open") is None
    browser.execute_script("window.exported = []; const make = URL.createObjectURL;"
                           "URL.createObjectURL = (b) => { window.exported.push(b); return make.call(URL, b); }")
    browser.find_element(By.ID, "export").click()
    text = browser.execute_async_script("const done = arguments[arguments.length - 1];"
                                        "window.exported[0].text().then(done)")
    doc = json.loads(text)
    assert doc["format"] == "pyllama.conversation" and doc["version"] == 1
    assert doc["conversation"]["title"] == "Weather"
    assert doc["conversation"]["messages"] == [
        {"role": "user", "content": "Weather?", "attachments": [{"name": "a.txt", "size": 2, "text": "hi"}]},
        {"role": "assistant", "content": "Let me look.", "reasoning": "a tool knows", "tool_calls": [call]}]
    path = tmp_path / "Weather.json"
    path.write_text(text)
    choose_files(browser, "import-file", path)
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#conversations li")) == 2)
    convs = json.loads(browser.execute_script("return localStorage.getItem('pyllama.conversations')"))
    assert convs[1]["id"] != "c1" and convs[1]["messages"] == convs[0]["messages"]
    assert browser.find_element(By.CSS_SELECTOR, "#conversations li.active").get_attribute("data-id") == convs[1]["id"]
    assert last_reply(browser).find_element(By.CLASS_NAME, "tool-name").text == "get_weather"
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "tool", "content": "x"}]}')
    choose_files(browser, "import-file", bad)
    wait(browser, lambda d: "could not import bad.json: message 0: role must be user or assistant"
         in d.find_element(By.ID, "status").text)
    assert console_errors(browser) == []


def test_display_settings(browser, key_server):
    """Settings a --ui-config can set too (the page reads both the same way): reasoning shown while
    it is written, Enter that does not send, long pastes as attachments, Markdown in user messages."""
    srv = key_server
    fresh(browser, srv.url + "/")
    browser.execute_script("localStorage.setItem('pyllama.apiKey', arguments[0]);"
                           "localStorage.setItem('pyllama.settings', arguments[1])", KEY,
                           json.dumps({"showThoughtInProgress": True, "sendOnEnter": False, "max_tokens": 8,
                                       "temperature": 0, "pasteLongTextToFileLen": 20,
                                       "renderUserContentAsMarkdown": True, "theme": "light"}))
    browser.refresh()
    ready(browser)
    assert browser.execute_script("return document.documentElement.dataset.theme") == "light"
    assert not browser.find_element(By.ID, "sendOnEnter").is_selected()
    box = browser.find_element(By.ID, "input")
    box.send_keys("Think **hard**\n")  # Enter: a new line, nothing sent
    assert messages(browser) == [] and box.get_attribute("value") == "Think **hard**\n"
    # a paste longer than pasteLongTextToFileLen becomes a text attachment
    browser.execute_script("const dt = new DataTransfer(); dt.setData('text/plain', arguments[1]);"
                           "arguments[0].dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt, bubbles: true,"
                           " cancelable: true}))", box, "a long pasted text, longer than twenty characters")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#pending .attachment"))
    assert box.get_attribute("value") == "Think **hard**\n"
    box.send_keys(Keys.CONTROL, Keys.ENTER)  # Ctrl+Enter sends
    wait_reply_done(browser, 2)
    user = messages(browser)[0]
    assert user.find_element(By.CSS_SELECTOR, ".content strong").text == "hard"
    assert user.find_element(By.CSS_SELECTOR, ".attachment").get_attribute("data-name") == "pasted.txt"
    reply = last_reply(browser)
    assert stored_reply(browser)["reasoning"]  # the template opened <think>: all of it is reasoning
    assert reply.find_element(By.CSS_SELECTOR, "details.reasoning").get_attribute("open") is not None
    assert reply.find_element(By.CLASS_NAME, "reasoning-text").is_displayed()
    assert console_errors(browser) == []


def test_pages_under_an_api_prefix(browser, tiny_model):
    """--api-prefix: the pages, their files and the calls they make all live under the prefix."""
    srv = ServerProcess(tiny_model, "-np", "1", "-c", "1024", "--ignore-eos", "--api-prefix", "/llama")
    try:
        ok = False
        for _ in range(100):  # /health lives under the prefix too
            try:
                ok = srv.request("GET", "/llama/health")[0] == 200
            except OSError:
                pass
            if ok:
                break
            time.sleep(0.1)
        assert ok and srv.request("GET", "/health")[0] == 404
        fresh(browser, srv.url + "/llama")  # redirected to /llama/
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
        set_field(browser, "max_tokens", "4")
        send_message(browser, "Hello")
        wait(browser, lambda d: last_reply(d).get_attribute("data-state") == "done")
        assert stored_reply(browser)["content"]
        seen = [urlsplit(u).path for u in requests_seen(browser)]
        browser.find_element(By.CSS_SELECTOR, "nav a").click()
        wait(browser, lambda d: urlsplit(d.current_url).path == "/llama/pipeline")
        wait(browser, lambda d: seen.extend(urlsplit(u).path for u in requests_seen(d)) or
             "/llama/pipeline/stats" in seen)
        assert console_errors(browser) == []
        assert {"/llama/v1/chat/completions", "/llama/pipeline", "/llama/webui/common.js",
                "/llama/webui/pipeline.js"} <= set(seen), seen  # (the chat page's own files: drained by fresh)
        assert all(p.startswith("/llama") for p in seen if p), seen
    finally:
        assert srv.stop() == 0


def test_no_webui_flag(tiny_model):
    srv = ServerProcess(tiny_model, "--no-webui").wait_ready()
    try:
        assert srv.request("GET", "/")[0] == 404
        assert srv.request("GET", "/pipeline")[0] == 404
        assert srv.request("GET", "/webui/chat.js")[0] == 404
        assert srv.request("GET", "/pipeline/stats")[0] == 200  # the data stays
    finally:
        assert srv.stop() == 0


# --- the pipeline view ------------------------------------------------------------------------------
def test_pipeline_view_matches_the_trace(browser, tiny_model, tmp_path):
    sys.path.insert(0, str(ROOT))
    from trace_tools import merge
    srv_trace, peer_trace = tmp_path / "server.jsonl", tmp_path / "peer.jsonl"
    peer = RPCServerProcess("--trace", str(peer_trace))
    srv = None
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        srv = ServerProcess(tiny_model, "--rpc", peer.endpoint, "--device", "RPC0,CPU", "-ts", "1,1", "-np", "4",
                            "-c", "2048", "--pipeline-groups", "2", "--trace", str(srv_trace)).wait_ready()

        def load() -> None:
            while not stop.is_set():
                srv.post("/completion", {"prompt": "The little cat", "n_predict": 48, "ignore_eos": True,
                                         "cache_prompt": False})

        threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        fresh(browser, srv.url + "/pipeline")
        # a few polls under load: the window spans seconds of steps of both groups
        body = browser.find_element(By.TAG_NAME, "body")
        wait(browser, lambda d: body.get_attribute("data-updated"))
        time.sleep(3.5)
        t_seen = body.get_attribute("data-updated")
        wait(browser, lambda d: body.get_attribute("data-updated") != t_seen)
        shot(browser, "webui-pipeline.png", height=1100)
        page = {}
        for row in browser.find_elements(By.CSS_SELECTOR, ".device"):
            assert row.get_attribute("data-measured") == "1", row.text
            page[row.get_attribute("data-device")] = {k: float(row.get_attribute(f"data-{k}"))
                                                      for k in ("busy", "waiting", "idle")}
        w0, w1 = int(body.get_attribute("data-w0")), int(body.get_attribute("data-w1"))
        groups = browser.find_elements(By.CSS_SELECTOR, "#groups tbody tr")
        links = browser.find_elements(By.CSS_SELECTOR, "#links tbody tr")
        assert console_errors(browser) == []
        assert_local_only(requests_seen(browser), srv)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        if srv is not None:
            assert srv.stop() == 0  # flushes the trace
        assert peer.stop() == 0
    assert sorted(page) == ["CPU", "RPC0"]
    assert [g.get_attribute("data-group") for g in groups] == ["0", "1"]
    assert [r.get_attribute("data-endpoint") for r in links] == [peer.endpoint]
    for shares in page.values():
        assert abs(sum(shares.values()) - 1) < 1e-6
    assert w1 - w0 > 2e6
    # the same window of the same run, from the trace files: per group, the devices' busy time
    # during that group's steps over the steps' time (merge.py --summary's columns)
    steps = merge.step_summary(merge.load([str(srv_trace), str(peer_trace)]))
    inside = steps[(steps["t0"] >= w0) & (steps["t0"] + steps["step_us"] <= w1)]
    for g in (0, 1):
        mine = inside[inside["grp"] == g]
        assert len(mine) > 50, len(mine)
        local = mine["local_busy_us"].sum() / mine["step_us"].sum()
        remote = mine["peer_busy_us"].sum() / mine["step_us"].sum()
        assert abs(page["CPU"]["busy"] - local) <= 0.10, (g, page, local, remote)
        assert abs(page["RPC0"]["busy"] - remote) <= 0.10, (g, page, local, remote)
