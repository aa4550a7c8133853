// The isthmus dashboard. Plain JavaScript, no library: the charts are SVG drawn here.
//
// Access: the token comes from the URL fragment (#token=..., which browsers never send to a
// server) or the login form; it is exchanged once for a session cookie at POST login, and the
// fragment is removed from the address bar. Live data arrives as server-sent events
// (v1/dashboard/stream), one full snapshot per event. Every piece of run data is written with
// textContent or SVG attributes, never as HTML: peer names and abort reasons come from peers.
"use strict";

(function () {
  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2f6fde", "#e07b39", "#1f9d55", "#c2417a", "#7c5cc4", "#0f9bb0",
    "#b8860b", "#5f6b7a", "#d64545", "#3b8f3b"];
  const $ = (id) => document.getElementById(id);
  let source = null;
  let retryTimer = null;
  let colors = new Map();

  // -------------------------------------------------------------------- access
  function show(state) {
    document.body.dataset.state = state;
    $("login").hidden = state !== "login";
    $("dash").hidden = state !== "live";
    $("logout").hidden = state !== "live";
  }

  function setConn(text, kind) {
    const c = $("conn");
    c.textContent = text;
    c.className = "conn conn-" + kind;
  }

  async function post(path, body) {
    return fetch(path, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
  }

  async function login(token) {
    let resp;
    try {
      resp = await post("login", { token: token });
    } catch (e) {
      showLogin("cannot reach the coordinator: " + e.message);
      return;
    }
    if (resp.ok) {
      connect();
    } else {
      const why = await resp.json().catch(() => ({}));
      showLogin(why.error || "the coordinator refused the token (" + resp.status + ")");
    }
  }

  function showLogin(message) {
    if (source) { source.close(); source = null; }
    clearRunData();
    show("login");
    setConn("not connected", "off");
    $("login-error").textContent = message || "";
    $("token").focus();
  }

  async function start() {
    const params = new URLSearchParams(location.hash.slice(1));
    const token = params.get("token");
    if (token) {
      // keep the token out of the address bar, history and screenshots
      history.replaceState(null, "", location.pathname + location.search);
      await login(token);
      return;
    }
    try {
      const resp = await fetch("v1/dashboard/session", { credentials: "same-origin" });
      if (resp.ok) { connect(); } else { showLogin(""); }
    } catch (e) {
      showLogin("cannot reach the coordinator: " + e.message);
    }
  }

  function connect() {
    if (source) source.close();
    clearTimeout(retryTimer);
    show("live");
    setConn("connecting", "off");
    source = new EventSource("v1/dashboard/stream");
    source.addEventListener("open", () => setConn("live", "live"));
    source.addEventListener("snapshot", (e) => {
      setConn("live", "live");
      render(JSON.parse(e.data));
    });
    source.addEventListener("error", () => {
      if (source && source.readyState === EventSource.CLOSED) {
        // refused (the cookie is no longer valid) or gone: ask which
        source = null;
        fetch("v1/dashboard/session", { credentials: "same-origin" })
          .then((r) => {
            if (r.status === 401) {
              showLogin("the coordinator no longer accepts this session; enter the token again");
            } else {
              retryTimer = setTimeout(connect, 2000);
            }
          })
          .catch(() => {
            setConn("connection lost, retrying", "lost");
            retryTimer = setTimeout(connect, 2000);
          });
      } else {
        setConn("connection lost, retrying", "lost"); // the browser reconnects by itself
      }
    });
  }

  // -------------------------------------------------------------------- formatting
  function fmtBytes(n) {
    if (n == null) return "-";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
  }
  function fmtSeconds(s) {
    if (s == null) return "-";
    if (s < 1) return (s * 1000).toFixed(0) + " ms";
    if (s < 60) return s.toFixed(1) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.round((s % 3600) / 60) + " min";
  }
  function fmtNum(v, digits) {
    return v == null ? "-" : Number(v).toFixed(digits);
  }
  function clock(snap, t) {
    const started = snap.run.started_at;
    if (started == null) return fmtSeconds(t);
    return new Date((started + t) * 1000).toLocaleTimeString([], { hour12: false });
  }
  function colorOf(name) {
    if (!colors.has(name)) colors.set(name, PALETTE[colors.size % PALETTE.length]);
    return colors.get(name);
  }

  // -------------------------------------------------------------------- DOM helpers
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function text(id, value) { $(id).textContent = value; }
  function cell(row, value, cls) {
    const td = document.createElement("td");
    if (value instanceof Node) td.appendChild(value); else td.textContent = value;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }
  function badge(kind, label) {
    const b = document.createElement("span");
    b.className = "badge " + kind;
    b.textContent = label || kind;
    return b;
  }
  function svgEl(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function svgText(parent, x, y, value, anchor) {
    const t = svgEl("text", { x: x, y: y, "text-anchor": anchor || "start" }, parent);
    t.textContent = value;
    return t;
  }

  function clearRunData() {
    for (const id of ["peers", "aborts", "events"]) clear($(id).tBodies[0]);
    for (const id of ["world-chart", "loss-chart", "bytes-chart", "round-chart"]) clear($(id));
    for (const id of ["member-count", "revision", "committed", "aborted", "parity-checks",
      "parity-failures", "bytes-total", "checkpoint"]) text(id, "-");
    for (const id of ["member-sub", "phase", "round-time", "resyncs", "speed", "checkpoint-sub",
      "run-id"]) text(id, "");
    colors = new Map();
  }

  // -------------------------------------------------------------------- charts
  function niceTicks(lo, hi, count, integer) {
    if (!(hi > lo)) hi = lo + 1;
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const norm = raw / mag;
    let step = (norm >= 5 ? 5 : norm >= 2 ? 2 : 1) * mag;
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
      out.push(Number(v.toPrecision(12)));
    }
    return out;
  }

  // A frame with axes: returns scale functions for data coordinates.
  function frame(svg, xr, yr, opts) {
    clear(svg);
    const w = svg.clientWidth || 440;
    const h = svg.clientHeight || 220;
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    const m = { l: opts.left || 48, r: 12, t: opts.top || 10, b: 26 };
    const X = (v) => m.l + (v - xr[0]) * (w - m.l - m.r) / ((xr[1] - xr[0]) || 1);
    const Y = (v) => h - m.b - (v - yr[0]) * (h - m.t - m.b) / ((yr[1] - yr[0]) || 1);
    for (const v of niceTicks(yr[0], yr[1], 4, opts.integerY)) {
      svgEl("line", { x1: m.l, x2: w - m.r, y1: Y(v), y2: Y(v), class: "grid-line" }, svg);
      svgText(svg, m.l - 6, Y(v) + 4, opts.fmtY ? opts.fmtY(v) : String(v), "end");
    }
    for (const v of niceTicks(xr[0], xr[1], 5, false)) {
      svgText(svg, X(v), h - 8, opts.fmtX ? opts.fmtX(v) : String(v), "middle");
    }
    svgEl("line", { x1: m.l, x2: w - m.r, y1: h - m.b, y2: h - m.b, class: "axis" }, svg);
    svgEl("line", { x1: m.l, x2: m.l, y1: m.t, y2: h - m.b, class: "axis" }, svg);
    return { X: X, Y: Y, w: w, h: h, m: m };
  }

  function empty(svg, message) {
    clear(svg);
    const w = svg.clientWidth || 440;
    const h = svg.clientHeight || 220;
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    svgText(svg, w / 2, h / 2, message, "middle").setAttribute("class", "empty");
  }

  function legend(svg, f, entries) {
    let x = f.w - f.m.r;
    for (let i = entries.length - 1; i >= 0; i--) {
      const [label, color] = entries[i];
      const t = svgText(svg, x, 12, label, "end");
      const width = label.length * 6.2;
      svgEl("rect", { x: x - width - 13, y: 4, width: 9, height: 9, fill: color }, svg);
      x -= width + 22;
      t.setAttribute("fill", "#1d2330");
    }
  }

  function minutes(v) {
    return v >= 120 ? (v / 60).toFixed(0) + "m" : v.toFixed(0) + "s";
  }

  function drawWorld(snap) {
    const svg = $("world-chart");
    const pts = snap.world_series;
    if (!pts.length) return empty(svg, "no epoch formed yet");
    const top = Math.max(2, ...pts.map((p) => p[1])) + 1;
    const f = frame(svg, [pts[0][0], Math.max(pts[pts.length - 1][0], pts[0][0] + 1)], [0, top],
      { integerY: true, fmtX: minutes });
    let d = "M" + f.X(pts[0][0]) + "," + f.Y(pts[0][1]);
    for (let i = 1; i < pts.length; i++) {
      d += "H" + f.X(pts[i][0]) + "V" + f.Y(pts[i][1]);
    }
    svgEl("path", { d: d, fill: "none", stroke: "#1d2330", "stroke-width": 2 }, svg);
    // aborts as ticks along the top, so a drop in the world size can be read against them
    for (const a of snap.aborts) {
      if (a.t < pts[0][0]) continue;
      svgEl("line", { x1: f.X(a.t), x2: f.X(a.t), y1: f.m.t, y2: f.m.t + 8,
        stroke: "#d64545", "stroke-width": 2 }, svg);
    }
  }

  function drawLoss(snap) {
    const svg = $("loss-chart");
    const names = Object.keys(snap.loss_series).sort();
    const all = names.flatMap((n) => snap.loss_series[n]);
    if (!all.length) return empty(svg, "no loss reported yet (session.report(loss=...))");
    const xs = all.map((p) => p[0]);
    const ys = all.map((p) => p[1]);
    const lo = Math.min(...ys);
    const hi = Math.max(...ys);
    const pad = (hi - lo) * 0.05 || 0.1;
    const f = frame(svg, [Math.min(...xs), Math.max(...xs, Math.min(...xs) + 1)],
      [Math.max(0, lo - pad), hi + pad], { fmtX: minutes, fmtY: (v) => v.toFixed(2), top: 20 });
    for (const n of names) {
      const p = snap.loss_series[n];
      const d = p.map((q, i) => (i ? "L" : "M") + f.X(q[0]).toFixed(1) + "," + f.Y(q[1]).toFixed(1));
      svgEl("path", { d: d.join(""), fill: "none", stroke: colorOf(n), "stroke-width": 1.5 }, svg);
    }
    legend(svg, f, names.slice(-6).map((n) => [n, colorOf(n)]));
  }

  function latestByName(peers) {
    const by = new Map();
    for (const p of peers) {
      const old = by.get(p.name);
      if (!old || p.id > old.id) by.set(p.name, p);
    }
    return [...by.values()];
  }

  function drawBytes(snap) {
    const svg = $("bytes-chart");
    const peers = latestByName(snap.peers).filter((p) => p.bytes_sent > 0)
      .sort((a, b) => a.name.localeCompare(b.name)).slice(0, 12);
    if (!peers.length) return empty(svg, "no bytes sent yet");
    const ops = [...new Set(peers.flatMap((p) => Object.keys(p.bytes_by_op)))].sort();
    const max = Math.max(...peers.map((p) => p.bytes_sent));
    clear(svg);
    const w = svg.clientWidth || 440;
    const h = svg.clientHeight || 220;
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    const left = 70;
    const right = 70;
    const top = 22;
    const row = Math.min(24, (h - top - 4) / peers.length);
    const opColor = (op) => PALETTE[(ops.indexOf(op) + 3) % PALETTE.length];
    peers.forEach((p, i) => {
      const y = top + i * row;
      svgText(svg, left - 6, y + row * 0.65, p.name, "end");
      let x = left;
      const parts = ops.length ? ops.map((op) => [op, p.bytes_by_op[op] || 0]) : [["all", p.bytes_sent]];
      for (const [op, n] of parts) {
        const width = (n / max) * (w - left - right);
        if (width <= 0) continue;
        const r = svgEl("rect", { x: x, y: y + 2, width: width, height: row - 5,
          fill: ops.length ? opColor(op) : PALETTE[0] }, svg);
        svgEl("title", {}, r).textContent = p.name + " " + op + ": " + fmtBytes(n);
        x += width;
      }
      svgText(svg, x + 6, y + row * 0.65, fmtBytes(p.bytes_sent));
    });
    legend(svg, { w: w, m: { r: 12 } }, ops.map((op) => [op, opColor(op)]));
  }

  function drawRounds(snap) {
    const svg = $("round-chart");
    const pts = snap.durations;
    if (!pts.length) return empty(svg, "no round finished yet");
    const xs = pts.map((p) => p[0]);
    const sorted = pts.map((p) => p[1]).sort((a, b) => a - b);
    const top = sorted[Math.floor(sorted.length * 0.98)] * 1.15 || 1; // a rare outlier stays off-scale
    const f = frame(svg, [Math.min(...xs), Math.max(...xs, Math.min(...xs) + 1)], [0, top],
      { fmtX: minutes, fmtY: (v) => fmtSeconds(v), top: 20, left: 56 });
    for (const [t, s, ok] of pts) {
      svgEl("circle", { cx: f.X(t), cy: f.Y(Math.min(s, top)), r: ok ? 2 : 3.5,
        fill: ok ? "#1f9d55" : "#d64545", "fill-opacity": ok ? 0.6 : 0.9 }, svg);
    }
    legend(svg, f, [["committed", "#1f9d55"], ["aborted", "#d64545"]]);
  }

  // -------------------------------------------------------------------- tables and cards
  function renderPeers(snap) {
    const body = $("peers").tBodies[0];
    clear(body);
    const waiting = new Set(snap.run.waiting_for);
    const rank = (p) => (p.member && p.state === "active" ? 0 : p.state === "active" ? 1 : 2);
    const peers = [...snap.peers].sort((a, b) => rank(a) - rank(b) || a.name.localeCompare(b.name)
      || b.id - a.id);
    for (const p of peers) {
      const row = document.createElement("tr");
      if (p.state !== "active") row.className = "gone";
      if (waiting.has(p.name)) row.className = "waiting";
      const name = cell(row, p.name);
      name.style.color = colorOf(p.name);
      cell(row, String(p.id));
      const st = badge(p.member && p.state === "active" ? "member" : p.state,
        p.member && p.state === "active" ? "member" : p.state);
      if (p.reason) st.title = p.reason;
      const stateCell = cell(row, st);
      if (waiting.has(p.name)) stateCell.appendChild(badge("epoch", "others wait for it"));
      if (p.isolated) {  // left out: a member cannot reach it (or it a member); title says who
        const iso = badge("isolated", "isolated");
        iso.title = p.isolated;
        stateCell.appendChild(iso);
      }
      cell(row, p.address ? p.address + (p.host ? " (" + p.host + ")" : "") : p.host || "-");
      cell(row, p.revision == null ? "-" : String(p.revision) + (p.in_sync ? "" : " (stale)"));
      cell(row, p.last_heartbeat_s == null ? "-" : fmtSeconds(p.last_heartbeat_s) + " ago");
      cell(row, p.step == null ? "-" : String(p.step));
      cell(row, fmtNum(p.steps_per_s, 2));
      cell(row, fmtNum(p.loss, 4));
      cell(row, fmtBytes(p.bytes_sent));
      cell(row, p.straggled ? p.straggled + " (" + fmtSeconds(p.straggle_s) + ")" : "-");
      body.appendChild(row);
    }
  }

  function renderCards(snap) {
    const run = snap.run;
    const c = snap.counters;
    const active = snap.peers.filter((p) => p.state === "active");
    text("run-id", "run " + run.id + " \u00b7 up " + fmtSeconds(run.uptime_s));
    text("member-count", String(run.world));
    const joining = active.filter((p) => !p.member).length;
    text("member-sub", "epoch " + run.epoch + (joining ? " \u00b7 " + joining + " joining" : ""));
    text("revision", String(run.revision));
    let phase = run.phase === "running" ? "round " + run.round + " running" : "forming round " + run.round;
    if (run.waiting_for.length) phase += " \u00b7 waiting for " + run.waiting_for.join(", ");
    text("phase", phase);
    text("committed", String(c.rounds_committed));
    text("aborted", String(c.rounds_aborted));
    const ok = snap.durations.filter((d) => d[2]).map((d) => d[1]).sort((a, b) => a - b);
    text("round-time", ok.length ? "median round " + fmtSeconds(ok[Math.floor(ok.length / 2)]) : "");
    text("parity-checks", String(c.parity_checks));
    text("parity-failures", String(c.parity_failures));
    $("parity-failures").className = c.parity_failures ? "bad" : "";
    text("resyncs", c.resyncs + " resyncs \u00b7 " + c.evictions + " evictions");
    const latest = latestByName(snap.peers);
    text("bytes-total", fmtBytes(latest.reduce((s, p) => s + (p.bytes_sent || 0), 0)));
    const speed = active.reduce((s, p) => s + (p.steps_per_s || 0), 0);
    text("speed", speed ? speed.toFixed(1) + " steps/s over all peers" : "");
    const ck = snap.checkpoint || {};
    if (ck.latest) {
      text("checkpoint", "rev " + ck.latest.revision);
      text("checkpoint-sub", fmtSeconds(snap.now - ck.latest.t) + " ago \u00b7 " + ck.written +
        " written" + (ck.failures ? " \u00b7 " + ck.failures + " failed parts" : ""));
      $("checkpoint-sub").title = ck.latest.path;
    } else {
      text("checkpoint", "none");
      text("checkpoint-sub", ck.url ? "to " + ck.url : "no checkpoint directory");
    }
  }

  function renderList(id, rows, fill) {
    const body = $(id).tBodies[0];
    clear(body);
    for (const r of rows) {
      const row = document.createElement("tr");
      fill(row, r);
      body.appendChild(row);
    }
  }

  function render(snap) {
    renderCards(snap);
    renderPeers(snap);
    renderList("aborts", snap.aborts, (row, a) => {
      cell(row, clock(snap, a.t));
      cell(row, String(a.round));
      cell(row, String(a.epoch));
      cell(row, a.reason, "wrap");
    });
    if (!snap.aborts.length) {
      renderList("aborts", [null], (row) => { cell(row, "none", "muted").colSpan = 4; });
    }
    renderList("events", snap.events, (row, e) => {
      cell(row, clock(snap, e.t));
      cell(row, badge(e.kind));
      cell(row, e.text, "wrap");
    });
    drawWorld(snap);
    drawLoss(snap);
    drawBytes(snap);
    drawRounds(snap);
  }

  // -------------------------------------------------------------------- wiring
  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const token = $("token").value.trim();
      $("token").value = "";
      if (token) login(token);
    });
    $("logout").addEventListener("click", async () => {
      if (source) { source.close(); source = null; }
      await post("logout", {}).catch(() => null);
      showLogin("logged out");
    });
    start();
  });
})();
