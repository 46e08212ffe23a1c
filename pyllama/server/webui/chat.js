// The chat page: conversations kept in this browser's localStorage, replies streamed from
// /v1/chat/completions (Server-Sent Events read from fetch's body), a stop button that aborts the
// request (the server then cancels the generation), the reasoning folded away, tool calls shown as
// they stream, user messages that can be edited and replies regenerated, text files attached,
// conversations exported and imported as JSON. The logic without a DOM lives in chatlogic.js; the
// server's --ui-config settings (/props ui_settings) are the defaults the user's changes sit on.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const { el } = Pyllama;
  const L = ChatLogic;
  const STORE = "pyllama.conversations";
  const CURRENT = "pyllama.current";
  const SETTINGS = "pyllama.settings"; // the settings this user changed, and only those
  // the form's element for a setting, where its id is not the setting's key
  const FIELD_IDS = { systemMessage: "system" };
  const fieldId = (key) => FIELD_IDS[key] || key;

  let conversations = load(STORE, []);
  let current = localStorage.getItem(CURRENT);
  let controller = null; // the AbortController of the request streaming now
  let uiSettings = {}; // the server's --ui-config, from /props
  let userSettings = migrate(load(SETTINGS, {}));
  let settings = L.effectiveSettings(uiSettings, userSettings);
  let pending = []; // attachments of the message being written

  function load(key, fallback) {
    try { const v = JSON.parse(localStorage.getItem(key)); return v == null ? fallback : v; } catch (e) { return fallback; }
  }
  // Settings saved by an earlier page: every field, as text, the system prompt as "system". Only
  // the values that differ from that page's defaults were the user's choice.
  function migrate(saved) {
    if (!saved || typeof saved !== "object" || !("system" in saved)) return saved || {};
    const old = { system: "", temperature: "0.8", top_k: "40", top_p: "0.95", min_p: "0.05", max_tokens: "-1", seed: "-1" };
    const out = {};
    for (const [k, v] of Object.entries(saved)) {
      if (old[k] === v) continue;
      out[k === "system" ? "systemMessage" : k] = v;
    }
    localStorage.setItem(SETTINGS, JSON.stringify(out));
    return out;
  }
  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(conversations));
    } catch (e) {
      status("could not keep the conversation in this browser: " + e.message, true);
    }
    if (current) localStorage.setItem(CURRENT, current); else localStorage.removeItem(CURRENT);
  }
  function conversation() { return conversations.find((c) => c.id === current) || null; }
  function replaceConversation(c) { conversations = conversations.map((x) => (x.id === c.id ? c : x)); }
  function newId() { return String(Date.now()) + Math.random().toString(16).slice(2, 8); }
  function status(text, isError) {
    const s = $("status");
    s.textContent = text || "";
    s.className = isError ? "error" : "muted";
  }

  // --- settings ---------------------------------------------------------------------------------
  function fieldValue(key) {
    const f = $(fieldId(key));
    return f.type === "checkbox" ? f.checked : f.value;
  }
  function showSettings() {
    for (const key of Object.keys(L.SCHEMA)) {
      const f = $(fieldId(key));
      if (!f) continue;
      if (f.type === "checkbox") f.checked = !!settings[key]; else f.value = String(settings[key]);
    }
    applyTheme();
  }
  function recompute() {
    settings = L.effectiveSettings(uiSettings, userSettings);
    showSettings();
  }
  function settingChanged(key) {
    const v = L.coerce(key, fieldValue(key));
    if (v === undefined) return;
    userSettings[key] = v;
    localStorage.setItem(SETTINGS, JSON.stringify(userSettings));
    settings = L.effectiveSettings(uiSettings, userSettings);
    if (key === "theme") applyTheme();
    if (key === "renderUserContentAsMarkdown") renderMessages();
  }
  function applyTheme() {
    document.documentElement.dataset.theme = settings.theme || "system";
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
    $("export").disabled = !conversation();
  }

  function attachmentChip(a, onRemove) {
    const chip = el("span", { class: "attachment", title: a.name, "data-name": a.name },
      el("span", { class: "name", text: a.name }), el("span", { class: "muted small", text: " " + L.sizeText(a.size) }));
    if (onRemove) {
      const x = el("button", { type: "button", class: "remove", title: "Remove", "aria-label": "Remove " + a.name, text: "\u00d7" });
      x.onclick = onRemove;
      chip.append(x);
    }
    return chip;
  }

  function messageNode(m, index) {
    const node = el("div", { class: "msg " + m.role, "data-index": String(index), "data-state": m.state || "done" });
    const head = el("div", { class: "head" }, el("span", { class: "role", text: m.role === "user" ? "You" : "Assistant" }));
    const actions = el("span", { class: "actions" });
    if (m.role === "user") {
      const edit = el("button", { type: "button", class: "edit", text: "Edit" });
      edit.onclick = () => startEdit(node, index);
      actions.append(edit);
    } else {
      const again = el("button", { type: "button", class: "regenerate", text: "Regenerate" });
      again.onclick = () => regenerate(index);
      actions.append(again);
    }
    head.append(actions);
    node.append(head);
    if (m.role === "assistant") {
      const details = el("details", { class: "reasoning" });
      details.append(el("summary", { text: "Reasoning" }), el("div", { class: "reasoning-text" }));
      // llama.cpp's showThoughtInProgress: the reasoning shows while it is being written
      if (m.state === "streaming" && settings.showThoughtInProgress) details.open = true;
      node.append(details, el("div", { class: "tool-calls" }));
    } else {
      node.append(el("div", { class: "attachments" }));
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
      const calls = node.querySelector(".tool-calls");
      calls.textContent = "";
      for (const c of m.tool_calls || []) {
        const fn = c.function || {};
        calls.append(el("div", { class: "tool-call", "data-name": fn.name || "" },
          el("div", { class: "tool-head" }, el("span", { class: "muted", text: "Tool call " }),
            el("code", { class: "tool-name", text: fn.name || "\u2026" })),
          el("pre", { class: "tool-args" }, el("code", { text: L.formatArguments(fn.arguments) }))));
      }
      const note = m.state === "stopped" ? "stopped" : m.state === "error" ? (m.error || "error") : "";
      if (note) content.append(el("p", { class: m.state === "error" ? "error note" : "muted note", text: "(" + note + ")" }));
    } else {
      if (settings.renderUserContentAsMarkdown) content.append(Markdown.render(m.content || ""));
      else content.textContent = m.content;
      const box = node.querySelector(".attachments");
      box.textContent = "";
      for (const a of m.attachments || []) box.append(attachmentChip(a));
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

  function renderPending() {
    const box = $("pending");
    box.textContent = "";
    pending.forEach((a, i) => box.append(attachmentChip(a, () => { pending.splice(i, 1); renderPending(); })));
  }

  function renderAll() { renderList(); renderMessages(); }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.dataset.busy = busy ? "1" : "0";
  }

  // --- editing and regenerating ---------------------------------------------------------------------
  function startEdit(node, index) {
    if (controller) return;
    const c = conversation();
    const m = c.messages[index];
    const content = node.querySelector(".content");
    content.textContent = "";
    const area = el("textarea", { class: "edit-input", rows: "3" });
    area.value = m.content;
    const saveBtn = el("button", { type: "button", class: "save-edit", text: "Send" });
    const cancel = el("button", { type: "button", class: "cancel-edit", text: "Cancel" });
    content.append(area, el("div", { class: "edit-buttons" }, saveBtn, cancel));
    node.dataset.editing = "1";
    area.focus();
    cancel.onclick = () => { delete node.dataset.editing; fill(node, m); };
    saveBtn.onclick = () => {
      const text = area.value.trim();
      if (!text && !(m.attachments && m.attachments.length)) return;
      if (controller) return;
      const edited = L.editMessage(c, index, text);
      replaceConversation(edited);
      generate(edited);
    };
  }

  function regenerate(index) {
    if (controller) return;
    const c = L.regenerateAt(conversation(), index);
    replaceConversation(c);
    generate(c);
  }

  // --- sending and streaming ----------------------------------------------------------------------
  function send(text, attachments) {
    let c = conversation();
    if (!c) {
      c = { id: newId(), title: "", messages: [], created: Date.now() };
      conversations.push(c);
      current = c.id;
    }
    if (!c.title) c.title = L.titleFor(text, attachments);
    const m = { role: "user", content: text };
    if (attachments.length) m.attachments = attachments;
    c.messages.push(m);
    generate(c);
  }

  // Streams a reply to the conversation's messages into a new assistant message at its end.
  async function generate(c) {
    let body;
    try { body = L.buildRequestBody(c.messages, settings); } catch (e) { status(e.message, true); save(); renderAll(); return; }
    const reply = L.newReply();
    c.messages.push(reply);
    save();
    renderAll();
    const node = $("messages").lastElementChild;
    controller = new AbortController();
    setBusy(true);
    status("");
    let chunks = 0;
    let painting = false;
    const scroll = () => { if (!settings.disableAutoScroll) $("messages").scrollTop = $("messages").scrollHeight; };
    const paint = () => {
      if (painting) return;
      painting = true;
      requestAnimationFrame(() => { painting = false; fill(node, reply); node.dataset.chunks = String(chunks); scroll(); });
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
        const cut = L.splitEvents(buf + decoder.decode(value, { stream: true }));
        buf = cut.rest;
        for (const data of cut.datas) {
          if (data === "[DONE]") continue;
          if (L.applyChunk(reply, JSON.parse(data))) { chunks++; paint(); }
          if (settings.showMessageStats && reply.timings) status(L.statsLine(reply.timings));
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

  // --- attachments --------------------------------------------------------------------------------
  function readFile(file) {
    return new Promise((resolve, reject) => {
      try { L.checkAttachmentSize(file.name, file.size); } catch (e) { reject(e); return; }
      const r = new FileReader();
      r.onload = () => {
        try { resolve(L.textAttachment(file.name, new Uint8Array(r.result))); } catch (e) { reject(e); }
      };
      r.onerror = () => reject(new Error("could not read " + file.name));
      r.readAsArrayBuffer(file);
    });
  }
  async function attachFiles(files) {
    for (const f of files) {
      try {
        pending.push(await readFile(f));
        status("");
      } catch (e) {
        status(e.message, true);
      }
    }
    renderPending();
  }

  // --- export and import --------------------------------------------------------------------------
  function exportCurrent() {
    const c = conversation();
    if (!c) return;
    const blob = new Blob([JSON.stringify(L.exportConversation(c), null, 2)], { type: "application/json" });
    const url = URL.createObjectURL(blob);
    const a = el("a", { href: url, download: L.exportFileName(c) });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }
  function importFile(file) {
    const r = new FileReader();
    r.onload = () => {
      try {
        const c = L.importConversation(JSON.parse(r.result), newId());
        conversations.push(c);
        current = c.id;
        save();
        renderAll();
        status("imported " + file.name);
      } catch (e) {
        status("could not import " + file.name + ": " + e.message, true);
      }
    };
    r.onerror = () => status("could not read " + file.name, true);
    r.readAsText(file);
  }

  // --- wiring ---------------------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", () => {
    showSettings();
    for (const key of Object.keys(L.SCHEMA)) {
      const f = $(fieldId(key));
      if (f) f.addEventListener("change", () => settingChanged(key));
    }
    $("reset-settings").onclick = () => { userSettings = {}; localStorage.removeItem(SETTINGS); recompute(); renderMessages(); };
    $("forget-key").onclick = () => { Pyllama.setApiKey(""); status("API key forgotten"); };
    $("new-chat").onclick = () => { if (!controller) { current = null; save(); renderAll(); $("input").focus(); } };
    $("export").onclick = exportCurrent;
    $("import").onclick = () => $("import-file").click();
    $("import-file").onchange = () => { const f = $("import-file").files[0]; if (f) importFile(f); $("import-file").value = ""; };
    $("attach").onclick = () => $("file").click();
    $("file").onchange = async () => { await attachFiles(Array.from($("file").files)); $("file").value = ""; };
    $("composer").onsubmit = (ev) => {
      ev.preventDefault();
      const text = $("input").value.trim();
      if ((!text && !pending.length) || controller) return;
      $("input").value = "";
      const attachments = pending;
      pending = [];
      renderPending();
      send(text, attachments);
    };
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key !== "Enter" || ev.isComposing) return;
      // sendOnEnter off: Enter is a new line and Ctrl/Cmd+Enter sends
      const sends = settings.sendOnEnter ? !ev.shiftKey : (ev.ctrlKey || ev.metaKey);
      if (sends) { ev.preventDefault(); $("composer").requestSubmit(); }
    });
    // llama.cpp's pasteLongTextToFileLen: a long paste becomes a text attachment (0: never)
    $("input").addEventListener("paste", (ev) => {
      const text = ev.clipboardData && ev.clipboardData.getData("text/plain");
      const limit = settings.pasteLongTextToFileLen;
      if (!text || !(limit > 0) || text.length <= limit) return;
      ev.preventDefault();
      try {
        pending.push(L.textAttachment("pasted.txt", new TextEncoder().encode(text)));
      } catch (e) {
        status(e.message, true);
      }
      renderPending();
    });
    $("stop").onclick = () => { if (controller) controller.abort(); };
    setBusy(false);
    renderAll();
    // the model's name and the server's --ui-config settings (defaults under what this user changed);
    // on a server with --api-key this is where the key is first asked for (from /props: the model
    // list is answered without a key, as llama-server's)
    Pyllama.apiFetch("props", {}, askKey).then(async (resp) => {
      if (!resp.ok) return;
      const p = await resp.json();
      if (p.model_alias) $("model").textContent = p.model_alias;
      uiSettings = p.ui_settings && typeof p.ui_settings === "object" ? p.ui_settings : {};
      document.body.dataset.uiApplied = L.applyUiSettings(L.defaults(), uiSettings).applied.join(",");
      const markdown = settings.renderUserContentAsMarkdown;
      recompute();
      // drawn again only when the settings change how messages look
      if (settings.renderUserContentAsMarkdown !== markdown) renderMessages();
      document.body.dataset.ready = "1";
    }).catch((e) => status(e.message, true));
  });
})();
