// The pipeline view: polls /pipeline/stats once a second and draws each device's busy / waiting /
// idle shares of the server's window, a minute of busy-share history, the groups and the links.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const { el } = Pyllama;
  const PERIOD_MS = 1000;
  const HISTORY = 60;
  const COLORS = ["#2f7de1", "#e8793a", "#3aa65b", "#a64fc4", "#c9a227", "#d1435b"];
  const history = []; // [{name: busy}] per poll, newest last
  let timer = null;

  const pct = (x) => (x == null ? "\u2013" : (100 * x).toFixed(1) + " %");
  const num = (x, d) => (x == null ? "\u2013" : x.toFixed(d));
  function bytes(x) {
    if (x == null) return "\u2013";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
    return (i ? x.toFixed(1) : Math.round(x)) + " " + units[i];
  }

  function askKey(message) {
    return new Promise((resolve) => {
      $("key-dialog").hidden = false;
      $("key-error").textContent = message || "";
      $("key-form").onsubmit = (ev) => {
        ev.preventDefault();
        const k = $("api-key").value.trim();
        if (!k) return;
        Pyllama.setApiKey(k);
        $("key-dialog").hidden = true;
        resolve(true);
      };
    });
  }

  function devices(snap) {
    const box = $("devices");
    box.textContent = "";
    snap.devices.forEach((d) => {
      const row = el("div", { class: "device", "data-device": d.name, "data-measured": d.measured ? "1" : "0" });
      if (d.measured) {
        row.dataset.busy = String(d.busy);
        row.dataset.waiting = String(d.waiting);
        row.dataset.idle = String(d.idle);
      }
      const label = el("div", { class: "label" }, el("strong", { text: d.name }),
        el("span", { class: "muted small", text: " " + (d.endpoint ? "rpc " + d.endpoint : d.kind) }));
      const bar = el("div", { class: "bar" });
      if (d.measured) {
        for (const part of ["busy", "waiting", "idle"]) {
          const seg = el("span", { class: "seg " + part, title: part + " " + pct(d[part]) });
          seg.style.width = (100 * d[part]).toFixed(2) + "%";
          bar.append(seg);
        }
      } else {
        bar.append(el("span", { class: "muted small", text: d.note || "not measured" }));
      }
      const figures = el("div", { class: "figures" },
        d.measured ? `busy ${pct(d.busy)} \u00b7 waiting ${pct(d.waiting)} \u00b7 idle ${pct(d.idle)}` : "");
      row.append(label, bar, figures);
      box.append(row);
    });
  }

  function table(id, rows) {
    const body = $(id).querySelector("tbody");
    body.textContent = "";
    for (const [attrs, cells] of rows) body.append(el("tr", attrs, ...cells.map((c) => el("td", { text: c }))));
  }

  function drawHistory(snap) {
    const point = {};
    for (const d of snap.devices) if (d.measured) point[d.name] = d.busy;
    history.push(point);
    if (history.length > HISTORY) history.shift();
    const c = $("history");
    const g = c.getContext("2d");
    const w = c.width, h = c.height, pad = 24;
    g.clearRect(0, 0, w, h);
    g.strokeStyle = "#ccc";
    g.fillStyle = "#777";
    g.font = "11px sans-serif";
    for (const y of [0, 0.5, 1]) {
      const py = h - pad - y * (h - 2 * pad);
      g.beginPath(); g.moveTo(pad + 16, py); g.lineTo(w - 4, py); g.stroke();
      g.fillText(Math.round(100 * y) + "%", 0, py + 4);
    }
    const names = snap.devices.map((d) => d.name);
    names.forEach((name, k) => {
      g.strokeStyle = COLORS[k % COLORS.length];
      g.lineWidth = 2;
      g.beginPath();
      let started = false;
      history.forEach((p, i) => {
        if (p[name] == null) return;
        const x = pad + 16 + (i + HISTORY - history.length) * (w - pad - 20) / (HISTORY - 1);
        const y = h - pad - p[name] * (h - 2 * pad);
        if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; }
      });
      g.stroke();
      g.fillStyle = COLORS[k % COLORS.length];
      g.fillText(name, pad + 16 + k * 90, h - 6);
    });
  }

  function show(snap) {
    document.body.dataset.updated = String(snap.t_us);
    document.body.dataset.w0 = String(snap.window_t0_us);
    document.body.dataset.w1 = String(snap.window_t1_us);
    $("window").textContent = `(last ${snap.window_s.toFixed(1)} s)`;
    $("summary").textContent = `${snap.devices.length} device(s), ${snap.groups.length} pipeline group(s), ` +
      `${num(snap.tokens_per_s, 1)} tokens/s` + (snap.idle_all != null ? `, no device busy ${pct(snap.idle_all)} of the time` : "");
    devices(snap);
    drawHistory(snap);
    table("groups", snap.groups.map((g) => [{ "data-group": String(g.group) },
      [String(g.group), g.step_ms == null ? "\u2013" : g.step_ms.toFixed(2) + " ms", num(g.batch_size, 1),
       num(g.tokens_per_s, 1), `${g.slots_busy} / ${g.slots}`, String(g.steps_total)]]));
    $("slots").textContent = `slots: ${snap.slots.busy} of ${snap.slots.total} busy, ${snap.slots.waiting} request(s) waiting`;
    table("links", snap.rpc.map((r) => [{ "data-endpoint": r.endpoint },
      [r.endpoint, num(r.round_trips_per_step, 2), bytes(r.bytes_out_per_step), bytes(r.bytes_in_per_step),
       String(r.round_trips_total), bytes(r.bytes_out_total), bytes(r.bytes_in_total)]]));
  }

  async function poll() {
    try {
      const resp = await Pyllama.apiFetch("pipeline/stats", {}, askKey);
      if (resp.ok) {
        show(await resp.json());
        $("error").textContent = "";
      } else {
        let msg = "HTTP " + resp.status;
        try { msg = (await resp.json()).error.message || msg; } catch (e) { /* not JSON */ }
        $("error").textContent = msg;
      }
    } catch (e) {
      $("error").textContent = "the server does not answer: " + e.message;
    }
    timer = setTimeout(poll, document.hidden ? 5 * PERIOD_MS : PERIOD_MS);
  }

  document.addEventListener("DOMContentLoaded", poll);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && timer) { clearTimeout(timer); poll(); }
  });
})();
