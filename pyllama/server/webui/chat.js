// The chat page: conversations kept in this browser's localStorage, replies streamed from
// /v1/chat/completions (Server-Sent Events read from fetch's body), a stop button that aborts the
// request (the server then cancels the generation), the reasoning text folded away.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const { el } = Pyllama;
  const STORE = "pyllama.conversations";
  const CURRENT = "pyllama.current";
  const SETTINGS = "pyllama.settings";
  const FIELDS = ["system", "temperature", "top_k", "top_p", "min_p", "max_tokens", "seed"];
  const DEFAULTS = { system: "", temperature: "0.8", top_k: "40", top_p: "0.95", min_p: "0.05", max_tokens: "-1", seed: "-1" };

  let conversations = load(STORE, []);
  let current = localStorage.getItem(CURRENT);
  let controller = null; // the AbortController of the request streaming now

  function load(key, fallback) {
    try { const v = JSON.parse(localStorage.getItem(key)); return v == null ? fallback : v; } catch (e) { return fallback; }
  }
  function save() {
    localStorage.setItem(STORE, JSON.stringify(conversations));
    if (current) localStorage.setItem(CURRENT, current); else localStorage.removeItem(CURRENT);
  }
  function conversation() { return conversations.find((c) => c.id === current) || null; }
  function status(text, isError) {
    const s = $("status");
    s.textContent = text || "";
    s.className = isError ? "error" : "muted";
  }

  // --- settings ---------------------------------------------------------------------------------
  function loadSettings() {
    const s = Object.assign({}, DEFAULTS, load(SETTINGS, {}));
    for (const f of FIELDS) $(f).value = s[f];
  }
  function saveSettings() {
    const s = {};
    for (const f of FIELDS) s[f] = $(f).value;
    localStorage.setItem(SETTINGS, JSON.stringify(s));
  }
  function requestParams() {
    const p = {};
    for (const f of FIELDS) {
      if (f === "system") continue;
      const raw = $(f).value.trim();
      if (raw === "") continue;
      const v = Number(raw);
      if (!Number.isFinite(v)) throw new Error(f + " must be a number");
      p[f] = (f === "top_k" || f === "max_tokens" || f === "seed") ? Math.trunc(v) : v;
    }
    return p;
  }

  // --- the API key dialog -------------------------------------------------------------------------
  function askKey(message) {
    return new Promise((resolve) => {
      const dlg = $("key-dialog");
      $("key-error").textContent = message || "";
      $("api-key").value = "";
      dlg.hidden = false;
      $("api-key").focus();
      const done = (ok) => {
        dlg.hidden = true;
        $("key-form").onsubmit = null;
        $("key-cancel").onclick = null;
        resolve(ok);
      };
      $("key-form").onsubmit = (ev) => {
        ev.preventDefault();
        const k = $("api-key").value.trim();
        if (!k) return;
        Pyllama.setApiKey(k);
        done(true);
      };
      $("key-cancel").onclick = () => done(false);
    });
  }

  // --- rendering ------------------------------------------------------------------------------------
  function renderList() {
    const ul = $("conversations");
    ul.textContent = "";
    for (const c of conversations.slice().reverse()) {
      const li = el("li", { class: c.id === current ? "active" : "", "data-id": c.id });
      const open = el("button", { type: "button", class: "open", text: c.title || "New conversation" });
      open.onclick = () => { if (!controller) { current = c.id; save(); renderAll(); } };
      const del = el("button", { type: "button", class: "delete", title: "Delete", "aria-label": "Delete", text: "\u00d7" });
      del.onclick = () => {
        if (controller && c.id === current) return;
        conversations = conversations.filter((x) => x.id !== c.id);
        if (current === c.id) current = null;
        save();
        renderAll();
      };
      li.append(open, del);
      ul.append(li);
    }
  }

  function messageNode(m, index) {
    const node = el("div", { class: "msg " + m.role, "data-index": String(index), "data-state": m.state || "done" });
    node.append(el("div", { class: "role", text: m.role === "user" ? "You" : "Assistant" }));
    if (m.role === "assistant") {
      const details = el("details", { class: "reasoning" });
      details.append(el("summary", { text: "Reasoning" }), el("div", { class: "reasoning-text" }));
      node.append(details);
    }
    node.append(el("div", { class: "content" }));
    fill(node, m);
    return node;
  }

  function fill(node, m) {
    node.dataset.state = m.state || "done";
    const content = node.querySelector(".content");
    content.textContent = "";
    if (m.role === "assistant") {
      content.append(Markdown.render(m.content || ""));
      const details = node.querySelector(".reasoning");
      details.hidden = !m.reasoning;
      details.querySelector(".reasoning-text").textContent = m.reasoning || "";
      const note = m.state === "stopped" ? "stopped" : m.state === "error" ? (m.error || "error") : "";
      if (note) content.append(el("p", { class: m.state === "error" ? "error note" : "muted note", text: "(" + note + ")" }));
    } else {
      content.textContent = m.content;
    }
  }

  function renderMessages() {
    const box = $("messages");
    box.textContent = "";
    const c = conversation();
    if (!c) { box.append(el("p", { class: "muted empty", text: "Start a conversation below." })); return; }
    c.messages.forEach((m, i) => box.append(messageNode(m, i)));
    box.scrollTop = box.scrollHeight;
  }

  function renderAll() { renderList(); renderMessages(); }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.dataset.busy = busy ? "1" : "0";
  }

  // --- sending and streaming ----------------------------------------------------------------------
  async function send(text) {
    let params;
    try { params = requestParams(); } catch (e) { status(e.message, true); return; }
    let c = conversation();
    if (!c) {
      c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 8), title: "", messages: [], created: Date.now() };
      conversations.push(c);
      current = c.id;
    }
    if (!c.title) c.title = text.slice(0, 40);
    c.messages.push({ role: "user", content: text });
    const reply = { role: "assistant", content: "", reasoning: "", state: "streaming" };
    c.messages.push(reply);
    save();
    renderAll();
    const node = $("messages").lastElementChild;
    const history = c.messages.slice(0, -1).map((m) => ({ role: m.role, content: m.content }));
    const system = $("system").value.trim();
    const body = Object.assign({ messages: system ? [{ role: "system", content: system }, ...history] : history,
      stream: true, stream_options: { include_usage: true } }, params);
    controller = new AbortController();
    setBusy(true);
    status("");
    let chunks = 0;
    let pending = false;
    const paint = () => {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => { pending = false; fill(node, reply); node.dataset.chunks = String(chunks); $("messages").scrollTop = $("messages").scrollHeight; });
    };
    try {
      const resp = await Pyllama.apiFetch("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal }, askKey);
      if (!resp.ok) {
        let msg = "HTTP " + resp.status;
        try { msg = (await resp.json()).error.message || msg; } catch (e) { /* not JSON */ }
        throw new Error(msg);
      }
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const obj = JSON.parse(data);
            if (obj.error) throw new Error(obj.error.message || "error");
            const choice = obj.choices && obj.choices[0];
            if (choice && choice.delta) {
              if (choice.delta.content) reply.content += choice.delta.content;
              if (choice.delta.reasoning_content) reply.reasoning += choice.delta.reasoning_content;
              chunks++;
              paint();
            }
            if (choice && choice.finish_reason) reply.finish_reason = choice.finish_reason;
            if (obj.timings && obj.timings.predicted_per_second) {
              status(obj.timings.predicted_n + " tokens, " + obj.timings.predicted_per_second.toFixed(1) + " tokens/s");
            }
          }
        }
      }
      reply.state = "done";
    } catch (e) {
      if (e.name === "AbortError") {
        reply.state = "stopped";
      } else {
        reply.state = "error";
        reply.error = e.message;
        status(e.message, true);
      }
    } finally {
      controller = null;
      setBusy(false);
      save();
      fill(node, reply);
      node.dataset.chunks = String(chunks);
    }
  }

  // --- wiring ---------------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", () => {
    loadSettings();
    for (const f of FIELDS) $(f).addEventListener("change", saveSettings);
    $("reset-settings").onclick = () => { localStorage.removeItem(SETTINGS); loadSettings(); };
    $("forget-key").onclick = () => { Pyllama.setApiKey(""); status("API key forgotten"); };
    $("new-chat").onclick = () => { if (!controller) { current = null; save(); renderAll(); $("input").focus(); } };
    $("composer").onsubmit = (ev) => {
      ev.preventDefault();
      const text = $("input").value.trim();
      if (!text || controller) return;
      $("input").value = "";
      send(text);
    };
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").onclick = () => { if (controller) controller.abort(); };
    setBusy(false);
    renderAll();
    // the model's name; on a server with --api-key this is where the key is first asked for (from
    // /props: the model list is answered without a key, as llama-server's)
    Pyllama.apiFetch("props", {}, askKey).then(async (resp) => {
      if (!resp.ok) return;
      const data = await resp.json();
      if (data.model_alias) $("model").textContent = data.model_alias;
      document.body.dataset.ready = "1";
    }).catch((e) => status(e.message, true));
  });
})();
