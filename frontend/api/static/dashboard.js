// kvroute live dashboard: polls /dashboard/data once a second and renders it. No libraries, no build step.
"use strict";
(function () {
  const POLL_MS = 1000;
  const COLORS = ["#58a6ff", "#3fb950", "#d29922", "#bc8cff", "#f85149", "#39c5cf"];
  const SHARES = [["available", "#58a6ff"], ["captured", "#3fb950"], ["delivered", "#d29922"]];
  const $ = (id) => document.getElementById(id);
  let token = sessionStorage.getItem("kvroute-admin-token") || "";
  const m = location.hash.match(/token=([^&]+)/);
  if (m) { token = decodeURIComponent(m[1]); sessionStorage.setItem("kvroute-admin-token", token); history.replaceState(null, "", location.pathname); }

  $("auth").addEventListener("submit", (e) => {
    e.preventDefault();
    token = $("token").value;
    sessionStorage.setItem("kvroute-admin-token", token);
    $("auth").hidden = true;
    poll();
  });

  function el(tag, attrs, text) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    return n;
  }
  const pct = (x) => (x === null || x === undefined ? "-" : (100 * x).toFixed(1) + " %");

  function renderRanks(ranks) {
    const body = $("ranks").tBodies[0];
    body.replaceChildren();
    const maxPrefill = Math.max(1, ...ranks.map((r) => r.active_prefill_tokens));
    const maxDecode = Math.max(1, ...ranks.map((r) => r.active_decode_blocks));
    for (const r of ranks) {
      const key = `${r.model}|${r.role}|${r.worker_id}|${r.dp_rank}`;
      const tr = el("tr", { "data-rank": key });
      tr.append(el("td", {}, r.model), el("td", {}, r.role), el("td", { "data-field": "worker_id" }, String(r.worker_id)),
        el("td", { "data-field": "dp_rank" }, String(r.dp_rank)),
        el("td", { "data-field": "healthy", class: r.healthy ? "ok" : "bad" }, r.healthy ? "healthy" : "down"),
        el("td", { "data-field": "busy", class: r.busy ? "warn" : "" }, r.busy ? "busy" : "no"),
        el("td", { "data-field": "active_prefill_tokens", class: "num" }, String(r.active_prefill_tokens)),
        el("td", { "data-field": "active_decode_blocks", class: "num" }, String(r.active_decode_blocks)),
        el("td", { "data-field": "kv_blocks_indexed", class: "num" }, String(r.kv_blocks_indexed)),
        el("td", { "data-field": "kv_events" }, r.kv_events === null ? "off" : r.kv_events),
        el("td", { "data-field": "kv_index_lag_ms", class: "num" }, r.kv_index_lag_ms === null || r.kv_index_lag_ms === undefined ? "-" : r.kv_index_lag_ms.toFixed(1)),
        el("td", { "data-field": "kv_batches_waiting", class: "num", title: "KV-event batches queued behind the first at the listener's last read" },
          r.kv_batches_waiting === null || r.kv_batches_waiting === undefined ? "-" : String(r.kv_batches_waiting)));
      const bar = el("div", { class: "bar", title: "prefill tokens (blue) / decode blocks (violet), relative to the busiest rank" });
      bar.append(el("span", { class: "p", style: `width:${(50 * r.active_prefill_tokens) / maxPrefill}%` }),
        el("span", { class: "d", style: `left:50%;width:${(50 * r.active_decode_blocks) / maxDecode}%` }));
      const td = el("td");
      td.append(bar);
      tr.append(td);
      body.append(tr);
    }
  }

  function chart(svg, series, yMax, fmt) {
    // series: [{name, color, points: [[t, y|null]...]}] over the history's time span
    svg.replaceChildren();
    const W = 600, H = 200, L = 40, B = 16;
    const ts = series.flatMap((s) => s.points.map((p) => p[0]));
    if (!ts.length) { svg.append(textAt(W / 2 - 60, H / 2, "waiting for data…")); return; }
    const t0 = Math.min(...ts), t1 = Math.max(...ts, t0 + 1);
    const top = yMax || Math.max(1e-9, ...series.flatMap((s) => s.points.map((p) => p[1] || 0))) * 1.15;
    const x = (t) => L + ((W - L - 4) * (t - t0)) / (t1 - t0);
    const y = (v) => H - B - ((H - B - 6) * v) / top;
    for (let i = 0; i <= 4; i++) {
      const v = (top * i) / 4;
      svg.append(svgEl("line", { class: "grid", x1: L, x2: W, y1: y(v), y2: y(v) }));
      svg.append(textAt(2, y(v) + 3, fmt(v)));
    }
    svg.append(textAt(L, H - 3, `${Math.round(t1 - t0)} s`));
    for (const s of series) {
      const pts = s.points.filter((p) => p[1] !== null).map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`);
      if (pts.length) svg.append(svgEl("polyline", { points: pts.join(" "), stroke: s.color }));
    }
  }
  function textAt(x, y, s) {
    const t = document.createElementNS("http://www.w3.org/2000/svg", "text");
    t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("class", "axis"); t.textContent = s;
    return t;
  }
  // SVG children need the SVG namespace
  const svgEl = (tag, attrs) => { const n = document.createElementNS("http://www.w3.org/2000/svg", tag); for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v); return n; };
  function legend(id, items) {
    const box = $(id);
    box.replaceChildren();
    for (const [name, color] of items) { const s = el("span"); const i = el("i", { style: `background:${color}` }); s.append(i, document.createTextNode(name)); box.append(s); }
  }

  function renderRecent(recent) {
    const body = $("recent").tBodies[0];
    body.replaceChildren();
    for (const d of recent) {
      const tr = el("tr", { "data-request": d.request_id });
      const cands = el("td", { class: "cands" });
      for (const c of d.candidates) {
        const s = el("span", { class: "cand" + (c.selected ? " sel" : "") },
          `w${c.worker_id}/${c.dp_rank}: ${c.overlap_blocks} cached, ${c.prefill_blocks.toFixed(1)} prefill, ${c.decode_blocks} decode \u2192 ${c.cost.toFixed(1)}   `);
        cands.append(s);
      }
      if (!d.candidates.length) cands.textContent = "(no cost terms in this mode)";
      tr.append(el("td", {}, new Date(d.time * 1000).toLocaleTimeString()), el("td", {}, d.request_id), el("td", {}, d.router),
        el("td", {}, d.model), el("td", { class: "num", "data-field": "isl" }, String(d.isl)),
        el("td", { "data-field": "chosen" }, `w${d.worker_id}/${d.dp_rank}`), cands);
      body.append(tr);
    }
  }

  function render(s) {
    $("mode").textContent = s.router_mode;
    $("process").textContent = String(s.process);
    $("pid").textContent = String(s.pid);
    $("seq").textContent = String(s.seq);
    $("time").textContent = new Date(s.time * 1000).toLocaleTimeString();
    $("decisions-total").textContent = String(s.decisions.total);
    const last = s.history.length ? s.history[s.history.length - 1] : null;
    const rate = last ? Object.values(last.decisions_per_s).reduce((a, b) => a + b, 0) : null;
    $("decisions-rate").textContent = rate === null ? "-" : rate.toFixed(1);
    const dec = s.decomposition;
    for (const [k] of SHARES) $("share-" + k).textContent = dec.prompt ? pct(dec[k] / dec.prompt) : "-";
    for (const td of $("decomposition").querySelectorAll("td[data-field]")) td.textContent = String(dec[td.dataset.field]);
    renderRanks(s.ranks);
    const modes = Object.keys(s.decisions.total_by_mode).sort();
    chart($("chart-decisions"), modes.map((mode, i) => ({ name: mode, color: COLORS[i % COLORS.length],
      points: s.history.map((h) => [h.time, h.decisions_per_s[mode] || 0]) })), 0, (v) => v.toFixed(1));
    legend("legend-decisions", modes.map((mode, i) => [mode, COLORS[i % COLORS.length]]));
    chart($("chart-decomposition"), SHARES.map(([k, color]) => ({ name: k, color, points: s.history.map((h) => [h.time, h[k]]) })), 1,
      (v) => Math.round(100 * v) + "%");
    legend("legend-decomposition", SHARES);
    renderRecent(s.recent);
    document.body.dataset.seq = String(s.seq);  // last: the page is complete for this snapshot
  }

  async function poll() {
    try {
      const r = await fetch("/dashboard/data", { headers: token ? { Authorization: "Bearer " + token } : {}, cache: "no-store" });
      if (r.status === 401 || r.status === 403) {
        $("status").textContent = "admin token needed";
        $("status").className = "status error";
        $("auth").hidden = false;
        return;  // resumes when the form is submitted
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      render(await r.json());
      $("status").textContent = "live";
      $("status").className = "status";
    } catch (e) {
      $("status").textContent = "no data: " + e.message;
      $("status").className = "status error";
    }
    setTimeout(poll, POLL_MS);
  }
  window.kvrouteDashboard = { render };
  poll();
})();
