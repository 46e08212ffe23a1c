// Shared by both pages: the API key kept in this browser, and fetch with it.
"use strict";
const Pyllama = (() => {
  const KEY = "pyllama.apiKey";
  function apiKey() { return localStorage.getItem(KEY) || ""; }
  function setApiKey(k) { if (k) localStorage.setItem(KEY, k); else localStorage.removeItem(KEY); }
  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = apiKey();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  }
  // fetch with the key; a 401 asks for a key (askKey resolves true once one is given) and retries
  async function apiFetch(path, init, askKey) {
    for (;;) {
      const opts = Object.assign({}, init || {});
      opts.headers = headers(opts.headers);
      const resp = await fetch(path, opts);
      if (resp.status !== 401 || !askKey) return resp;
      let message = "";
      try { message = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
      if (!(await askKey(apiKey() ? (message || "the key was refused") : ""))) return resp;
    }
  }
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    for (const c of children) if (c != null) e.append(c);
    return e;
  }
  return { apiKey, setApiKey, apiFetch, el };
})();
