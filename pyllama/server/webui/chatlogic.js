// The chat page's logic with no DOM in it: settings (the page's defaults, a server's --ui-config
// settings from /props, the user's own changes), request bodies, streamed deltas accumulated into
// a reply, conversation edits, attachments and export/import. Kept free of the page so that node
// can run it in the tests; in a browser it is the global ChatLogic, under node module.exports.
"use strict";
const ChatLogic = (() => {
  // Every setting the page has a feature for, under llama.cpp's web UI key names so that a
  // --ui-config written for llama-server works here too. kind: how a value is checked; param: the
  // request field it is sent as (a sampling setting); "" for a number means the server's default.
  const SCHEMA = {
    systemMessage: { kind: "string", def: "" },
    temperature: { kind: "number", def: 0.8, param: "temperature" },
    top_k: { kind: "int", def: 40, param: "top_k" },
    top_p: { kind: "number", def: 0.95, param: "top_p" },
    min_p: { kind: "number", def: 0.05, param: "min_p" },
    max_tokens: { kind: "int", def: -1, param: "max_tokens" },
    seed: { kind: "int", def: -1, param: "seed" },
    dynatemp_range: { kind: "number", def: "", param: "dynatemp_range" },
    dynatemp_exponent: { kind: "number", def: "", param: "dynatemp_exponent" },
    // llama.cpp's UI names it typ_p; the request field both servers read is typical_p
    typ_p: { kind: "number", def: "", param: "typical_p" },
    xtc_probability: { kind: "number", def: "", param: "xtc_probability" },
    xtc_threshold: { kind: "number", def: "", param: "xtc_threshold" },
    repeat_last_n: { kind: "int", def: "", param: "repeat_last_n" },
    repeat_penalty: { kind: "number", def: "", param: "repeat_penalty" },
    presence_penalty: { kind: "number", def: "", param: "presence_penalty" },
    frequency_penalty: { kind: "number", def: "", param: "frequency_penalty" },
    dry_multiplier: { kind: "number", def: "", param: "dry_multiplier" },
    dry_base: { kind: "number", def: "", param: "dry_base" },
    dry_allowed_length: { kind: "int", def: "", param: "dry_allowed_length" },
    dry_penalty_last_n: { kind: "int", def: "", param: "dry_penalty_last_n" },
    samplers: { kind: "samplers", def: "" },
    custom: { kind: "json", def: "" },
    showThoughtInProgress: { kind: "bool", def: false },
    disableReasoningParsing: { kind: "bool", def: false },
    showMessageStats: { kind: "bool", def: true },
    sendOnEnter: { kind: "bool", def: true },
    renderUserContentAsMarkdown: { kind: "bool", def: false },
    disableAutoScroll: { kind: "bool", def: false },
    pasteLongTextToFileLen: { kind: "int", def: 2500 },
    theme: { kind: "theme", def: "system" },
  };
  const THEMES = ["system", "light", "dark"];
  const MAX_ATTACHMENT_BYTES = 512 * 1024;
  const EXPORT_FORMAT = "pyllama.conversation";

  function defaults() {
    const s = {};
    for (const [k, spec] of Object.entries(SCHEMA)) s[k] = spec.def;
    return s;
  }

  // The value as the page keeps it, or undefined when it does not fit the setting (then the
  // setting is left alone, as llama.cpp's UI leaves a value it cannot use).
  function coerce(key, value) {
    const spec = SCHEMA[key];
    if (!spec) return undefined;
    switch (spec.kind) {
      case "string":
        return typeof value === "string" ? value : undefined;
      case "number":
      case "int": {
        if (value === "" || value === null) return ""; // an emptied field: not sent
        const v = typeof value === "number" ? value : typeof value === "string" && value.trim() !== "" ? Number(value) : NaN;
        if (!Number.isFinite(v)) return undefined;
        return spec.kind === "int" ? Math.trunc(v) : v;
      }
      case "bool":
        if (typeof value === "boolean") return value;
        if (value === "true" || value === "false") return value === "true";
        return undefined;
      case "theme":
        return THEMES.includes(value) ? value : undefined;
      case "samplers":
        if (typeof value === "string") return value;
        if (Array.isArray(value) && value.every((x) => typeof x === "string")) return value.join(";");
        return undefined;
      case "json":
        if (typeof value === "string") return value;
        if (value && typeof value === "object" && !Array.isArray(value)) return JSON.stringify(value);
        return undefined;
    }
    return undefined;
  }

  // Lays `given` (a server's ui_settings or the user's saved changes) over `base`. Keys the page
  // has no feature for, and values of the wrong type, are skipped without a word, as llama.cpp's
  // UI skips them; they are listed in `ignored` for whoever wants to know.
  function applyUiSettings(base, given) {
    const settings = Object.assign({}, base);
    const applied = [];
    const ignored = [];
    if (given && typeof given === "object" && !Array.isArray(given)) {
      for (const [k, v] of Object.entries(given)) {
        const c = Object.prototype.hasOwnProperty.call(SCHEMA, k) ? coerce(k, v) : undefined;
        if (c === undefined) { ignored.push(k); continue; }
        settings[k] = c;
        applied.push(k);
      }
    }
    return { settings, applied, ignored };
  }

  // The page's defaults, then the server's --ui-config, then what the user changed in this browser.
  function effectiveSettings(uiSettings, userSettings) {
    return applyUiSettings(applyUiSettings(defaults(), uiSettings).settings, userSettings).settings;
  }

  // The sampling fields of a request. A number setting left empty is not sent (the server's
  // default applies); max_tokens 0 means no limit, as in llama.cpp's UI.
  function requestParams(settings) {
    const p = {};
    for (const [k, spec] of Object.entries(SCHEMA)) {
      if (!spec.param) continue;
      const raw = settings[k];
      if (raw === "" || raw === undefined || raw === null) continue;
      const v = Number(raw);
      if (!Number.isFinite(v)) throw new Error(k + " must be a number");
      p[spec.param] = spec.kind === "int" ? Math.trunc(v) : v;
    }
    if (p.max_tokens === 0) p.max_tokens = -1;
    const samplers = String(settings.samplers || "").split(";").map((x) => x.trim()).filter((x) => x);
    if (samplers.length) p.samplers = samplers;
    return p;
  }

  // A user's custom JSON: extra request fields laid over the page's own.
  function customFields(text) {
    if (!text || !String(text).trim()) return {};
    let v;
    try { v = JSON.parse(text); } catch (e) { throw new Error("custom JSON does not parse: " + e.message); }
    if (!v || typeof v !== "object" || Array.isArray(v)) throw new Error("custom JSON must be an object");
    return v;
  }

  // How a text attachment travels: a text part of its own after the message's text, headed by the
  // file's name (the layout llama.cpp's UI sends, so a model sees the same prompt from both pages).
  function attachmentPart(a) {
    return { type: "text", text: "\n\n--- File: " + a.name + " ---\n" + a.text };
  }

  function apiMessage(m) {
    if (m.role === "user" && Array.isArray(m.attachments) && m.attachments.length) {
      const parts = m.content ? [{ type: "text", text: m.content }] : [];
      for (const a of m.attachments) parts.push(attachmentPart(a));
      return { role: "user", content: parts };
    }
    // reasoning stays out of the context, and so do tool calls: the page runs no tools, so no tool
    // result could follow them
    return { role: m.role, content: m.content || "" };
  }

  // The body of POST /v1/chat/completions for a conversation's messages (the reply being written
  // is not among them).
  function buildRequestBody(messages, settings) {
    const history = messages.map(apiMessage);
    const system = String(settings.systemMessage || "").trim();
    const body = Object.assign({ messages: system ? [{ role: "system", content: system }, ...history] : history,
      stream: true, stream_options: { include_usage: true } }, requestParams(settings));
    if (settings.disableReasoningParsing) body.reasoning_format = "none";
    return Object.assign(body, customFields(settings.custom));
  }

  // --- the streamed reply ---------------------------------------------------------------------------
  function newReply() {
    return { role: "assistant", content: "", reasoning: "", tool_calls: [], state: "streaming" };
  }

  // Cuts Server-Sent Events out of what arrived so far: the data of each whole event, and the
  // unfinished rest to keep for the next read.
  function splitEvents(buffer) {
    const datas = [];
    let buf = buffer.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) datas.push(line.slice(6));
        else if (line.startsWith("data:")) datas.push(line.slice(5));
      }
    }
    return { datas, rest: buf };
  }

  // Folds one streamed chunk (a parsed data line) into the reply. Tool calls arrive in pieces keyed
  // by index: the first piece of a call carries its id and name, the following ones more of its
  // arguments' text. Returns true when something to draw changed; throws on an error event.
  function applyChunk(reply, obj) {
    if (obj && obj.error) throw new Error(obj.error.message || "error");
    let changed = false;
    const choice = obj && obj.choices && obj.choices[0];
    const delta = choice && choice.delta;
    if (delta) {
      if (typeof delta.content === "string" && delta.content) { reply.content += delta.content; changed = true; }
      if (typeof delta.reasoning_content === "string" && delta.reasoning_content) {
        reply.reasoning = (reply.reasoning || "") + delta.reasoning_content;
        changed = true;
      }
      if (Array.isArray(delta.tool_calls)) {
        if (!reply.tool_calls) reply.tool_calls = [];
        for (const d of delta.tool_calls) {
          const i = Number.isInteger(d.index) && d.index >= 0 ? d.index : reply.tool_calls.length;
          while (reply.tool_calls.length <= i) reply.tool_calls.push({ id: "", type: "function", function: { name: "", arguments: "" } });
          const call = reply.tool_calls[i];
          if (d.id) call.id = d.id;
          if (d.type) call.type = d.type;
          if (d.function) {
            if (d.function.name) call.function.name += d.function.name;
            if (typeof d.function.arguments === "string") call.function.arguments += d.function.arguments;
          }
          changed = true;
        }
      }
    }
    if (choice && choice.finish_reason) reply.finish_reason = choice.finish_reason;
    if (obj && obj.timings) reply.timings = obj.timings;
    return changed;
  }

  // A call's arguments for display: indented JSON once they parse, the raw text while they stream.
  function formatArguments(text) {
    if (!text) return "";
    try { return JSON.stringify(JSON.parse(text), null, 2); } catch (e) { return text; }
  }

  function statsLine(timings) {
    if (!timings || !timings.predicted_per_second) return "";
    return timings.predicted_n + " tokens, " + timings.predicted_per_second.toFixed(1) + " tokens/s";
  }

  // --- conversation transforms (each returns a new conversation, the old one untouched) ------------
  function copy(conv) { return JSON.parse(JSON.stringify(conv)); }

  // The user message at `index` gets `text`; everything after it goes (its reply is written again).
  function editMessage(conv, index, text) {
    const m = conv.messages[index];
    if (!m || m.role !== "user") throw new Error("only a user message can be edited");
    const out = copy(conv);
    out.messages = out.messages.slice(0, index + 1);
    out.messages[index].content = text;
    if (index === 0) out.title = titleFor(text, out.messages[0].attachments);
    return out;
  }

  // The assistant reply at `index` and everything after it go; the messages before it are what
  // the new reply answers.
  function regenerateAt(conv, index) {
    const m = conv.messages[index];
    if (!m || m.role !== "assistant") throw new Error("only an assistant reply can be regenerated");
    const out = copy(conv);
    out.messages = out.messages.slice(0, index);
    return out;
  }

  function lastAssistantIndex(conv) {
    for (let i = conv.messages.length - 1; i >= 0; i--) if (conv.messages[i].role === "assistant") return i;
    return -1;
  }

  function titleFor(text, attachments) {
    const t = String(text || "").trim() || (attachments && attachments[0] ? attachments[0].name : "");
    return t.slice(0, 40);
  }

  // --- attachments ----------------------------------------------------------------------------------
  function sizeText(n) {
    return n >= 1024 * 1024 ? (n / 1024 / 1024).toFixed(1) + " MiB" : n >= 1024 ? Math.ceil(n / 1024) + " KiB" : n + " bytes";
  }

  // Checked before the file is read, so a large file is never loaded.
  function checkAttachmentSize(name, size, limit) {
    const max = limit || MAX_ATTACHMENT_BYTES;
    if (size > max) throw new Error(name + " is too large to attach (" + sizeText(size) + "; the limit is " + sizeText(max) + ")");
  }

  // A file's bytes as a text attachment: UTF-8 without NUL bytes, else refused as binary (an image,
  // an archive, a PDF: this page sends text only).
  function textAttachment(name, bytes, limit) {
    checkAttachmentSize(name, bytes.length, limit);
    let text;
    try {
      if (bytes.indexOf(0) >= 0) throw new Error("NUL");
      text = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
    } catch (e) {
      throw new Error(name + " is not a text file (only UTF-8 text can be attached)");
    }
    return { name: String(name), size: bytes.length, text };
  }

  // --- export and import ------------------------------------------------------------------------------
  function cleanMessage(m) {
    const out = { role: m.role, content: m.content || "" };
    if (m.role === "user" && Array.isArray(m.attachments) && m.attachments.length) {
      out.attachments = m.attachments.map((a) => ({ name: a.name, size: a.size, text: a.text }));
    }
    if (m.role === "assistant") {
      if (m.reasoning) out.reasoning = m.reasoning;
      if (Array.isArray(m.tool_calls) && m.tool_calls.length) out.tool_calls = copy(m.tool_calls);
      if (m.finish_reason) out.finish_reason = m.finish_reason;
      // a reply cut short keeps saying so; one still streaming when exported reads as stopped
      const state = m.state === "streaming" ? "stopped" : m.state;
      if (state && state !== "done") out.state = state;
      if (m.error) out.error = m.error;
    }
    return out;
  }

  function exportConversation(conv, now) {
    return {
      format: EXPORT_FORMAT, version: 1, exported: new Date(now === undefined ? Date.now() : now).toISOString(),
      conversation: { id: conv.id, title: conv.title || "", created: conv.created || 0,
        messages: conv.messages.map(cleanMessage) },
    };
  }

  function exportFileName(conv) {
    const base = String(conv.title || "conversation").replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^_+|_+$/g, "").slice(0, 40);
    return (base || "conversation") + ".json";
  }

  // The inverse of exportConversation (a bare {title, messages} object is taken too). Refuses
  // anything it cannot draw, saying where; the conversation gets the id given.
  function importConversation(doc, id) {
    if (!doc || typeof doc !== "object") throw new Error("not a conversation: expected a JSON object");
    if (doc.format !== undefined && doc.format !== EXPORT_FORMAT) throw new Error("unknown format " + JSON.stringify(doc.format));
    const c = doc.format === EXPORT_FORMAT ? doc.conversation : doc;
    if (!c || typeof c !== "object" || !Array.isArray(c.messages)) throw new Error("not a conversation: no messages list");
    const messages = c.messages.map((m, i) => {
      if (!m || (m.role !== "user" && m.role !== "assistant")) throw new Error("message " + i + ": role must be user or assistant");
      if (typeof m.content !== "string") throw new Error("message " + i + ": content must be a string");
      if (m.attachments !== undefined && (!Array.isArray(m.attachments) ||
          !m.attachments.every((a) => a && typeof a.name === "string" && typeof a.text === "string"))) {
        throw new Error("message " + i + ": attachments must be a list of {name, text}");
      }
      const out = cleanMessage(m);
      if (m.role === "assistant") {
        out.reasoning = typeof m.reasoning === "string" ? m.reasoning : "";
        out.state = typeof m.state === "string" && m.state !== "streaming" ? m.state : "done";
        if (!Array.isArray(out.tool_calls)) out.tool_calls = [];
      }
      return out;
    });
    return { id: String(id), title: typeof c.title === "string" && c.title ? c.title : titleFor(messages[0] ? messages[0].content : ""),
      created: typeof c.created === "number" ? c.created : 0, messages };
  }

  return { SCHEMA, THEMES, MAX_ATTACHMENT_BYTES, EXPORT_FORMAT, defaults, coerce, applyUiSettings, effectiveSettings,
    requestParams, customFields, apiMessage, buildRequestBody, newReply, splitEvents, applyChunk, formatArguments,
    statsLine, editMessage, regenerateAt, lastAssistantIndex, titleFor, sizeText, checkAttachmentSize,
    textAttachment, exportConversation, exportFileName, importConversation };
})();
if (typeof window !== "undefined") window.ChatLogic = ChatLogic;
if (typeof module !== "undefined" && module.exports) module.exports = ChatLogic;
