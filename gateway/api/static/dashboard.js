// The Mirror-SD dashboard: polls GET /v1/dashboard about once a second and redraws.
// Data from Redis (worker ids, pool names) is only ever set as textContent, never as HTML.
"use strict";

const POLL_MS = 1000;
const KEY_STORE = "mirror-sd-api-key";
const PALETTE = ["#4e9af1", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7"];
const poolColors = new Map();
let waitingForKey = false;

function colorOf(pool) {
  if (!poolColors.has(pool)) poolColors.set(pool, PALETTE[poolColors.size % PALETTE.length]);
  return poolColors.get(pool);
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

const fmt = {
  pct: (v) => (v === null || v === undefined ? "-" : `${Math.round(v * 100)}%`),
  temp: (v) => (v === null || v === undefined ? "-" : `${v.toFixed(1)} °C`),
  ms: (v) => (v === null || v === undefined ? "-" : `${Math.round(v)} ms`),
  mib: (v) => `${(v / (1024 * 1024)).toFixed(1)} MiB`,
  num: (v, digits = 1) => (v === null || v === undefined ? "-" : Number(v).toFixed(digits)),
  clock: (t) => new Date(t * 1000).toLocaleTimeString([], {hour12: false}),
};

function utilCell(value) {
  const fill = el("span", {class: "fill"});
  fill.style.width = `${Math.round(Math.min(Math.max(value, 0), 1) * 100)}%`;
  return el("td", {class: "util"}, el("span", {class: "meter"}, fill), fmt.pct(value));
}

function workerRow(w) {
  const badges = el("td", {class: "flags"});
  if (w.hot) badges.append(el("span", {class: "badge hot"}, "hot"));
  if (w.alert) badges.append(el("span", {class: "badge alert"}, "rejections"));
  if (w.overridden.length) badges.append(el("span", {class: "badge injected", title: w.overridden.join(", ")},
                                            "injected"));
  if (w.draft_fallback) badges.append(fallbackBadge(w));
  return el("tr", {"data-worker": w.worker_id, class: w.hot ? "hot" : ""},
    el("td", {class: "id"}, w.worker_id),
    el("td", {class: "device"}, w.device_kind),
    el("td", {class: "temp"}, fmt.temp(w.temperature_c)),
    utilCell(w.utilization),
    el("td", {class: "sessions"}, w.num_sessions),
    el("td", {class: "queue"}, w.queue_depth),
    el("td", {class: "kv"}, fmt.mib(w.kv_cache_bytes)),
    el("td", {class: "accept"}, fmt.pct(w.acceptance_rate)),
    el("td", {class: "p99"}, fmt.ms(w.latency_p99_ms)),
    el("td", {class: "age"}, `${fmt.num(w.age_s)} s`),
    badges);
}

// A draft worker's link to Redis (services/link/meter.py): its PING, a round's block-to-verdict trip, and the
// blocks it keeps out ahead of their verdicts with the share of rounds verified ahead, and the blocks it had to
// send again (to a live worker that never answered; to the pool when their worker died).
function linkCells(link) {
  const l = link || {};
  const ahead = l.blocks_ahead === null || l.blocks_ahead === undefined ? "-"
    : `${l.blocks_ahead}${l.verified_ahead === null || l.verified_ahead === undefined ? ""
      : ` (${fmt.pct(l.verified_ahead)} of rounds)`}`;
  return [el("td", {class: "rtt"}, fmt.ms(l.redis_rtt_ms)),
    el("td", {class: "round-trip"}, l.round_trip_ms_p50 === null || l.round_trip_ms_p50 === undefined ? "-"
      : `${fmt.ms(l.round_trip_ms_p50)} / ${fmt.ms(l.round_trip_ms_p99)}`),
    el("td", {class: "ahead"}, ahead),
    el("td", {class: "resent"}, `${l.resent_blocks || 0} / ${l.failed_over_blocks || 0}`)];
}

function fallbackBadge(w) {
  return el("span", {class: "badge alert", title: w.draft_fallback.reason}, `fallback (${w.draft_fallback.fault})`);
}

function workerTable(workers) {
  const head = ["worker", "device", "temp", "util", "sessions", "queue", "KV", "accept", "p99/token", "beat", ""];
  return el("table", {class: "workers verify"},
    el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))),
    el("tbody", {}, ...workers.map(workerRow)));
}

function renderPools(snap) {
  const routing = snap.routing || {pool_weights: {}, degraded_pools: [], ar_pools: []};
  const verify = snap.workers.filter((w) => w.role === "verify");
  const pools = [...new Set([...Object.keys(routing.pool_weights), ...verify.map((w) => w.pool)])].sort();
  pools.forEach(colorOf);
  const cards = pools.map((pool) => {
    const members = verify.filter((w) => w.pool === pool);
    const badges = el("span", {class: "badges"});
    if (pool === snap.gateway.fallback_pool) badges.append(el("span", {class: "badge"}, "fallback"));
    if (members.some((w) => w.hot)) badges.append(el("span", {class: "badge hot"}, "hot: traffic moved"));
    if (routing.degraded_pools.includes(pool)) badges.append(el("span", {class: "badge alert"}, "degraded"));
    if (routing.ar_pools.includes(pool)) badges.append(el("span", {class: "badge"}, "target-only"));
    const swatch = el("span", {class: "swatch"});
    swatch.style.background = colorOf(pool);
    const weight = routing.pool_weights[pool];
    return el("div", {class: "pool", "data-pool": pool},
      el("div", {class: "pool-head"}, swatch, el("span", {class: "pool-name"}, pool),
         el("span", {class: "weight"}, weight === undefined ? "-" : fmt.pct(weight)),
         el("span", {class: "muted"}, "of new sessions"), badges),
      members.length ? workerTable(members) : el("p", {class: "muted"}, "no live verify worker"));
  });
  document.getElementById("pools").replaceChildren(...(cards.length ? cards
    : [el("p", {class: "muted"}, "no verify worker is heartbeating")]));
  const drafts = snap.workers.filter((w) => w.role === "draft");
  const local = verify.filter((w) => w.local_draft);
  const notes = local.length ? [el("p", {class: "local-note"}, "The verify workers draft for their own sessions " +
    `(placement local): ${local.map((w) => `${w.worker_id} with ${w.local_draft}`).join(", ")}`),
    ...local.filter((w) => Object.keys(w.local_turns || {}).length).map((w) =>
      el("p", {class: "muted local-turns", "data-worker": w.worker_id}, `${w.worker_id} drafts at loads ` +
        `(sessions in a turn) where its drafting turns commit more tokens per second than its plain ones: ` +
        Object.entries(w.local_turns).sort((a, b) => Number(a[0]) - Number(b[0])).map(([load, arms]) =>
          `${load}: ${["draft", "plain"].filter((arm) => arm in arms).map((arm) =>
            `${arm} ${Math.round(arms[arm])}`).join(" / ")} tok/s`).join("; ")))] : [];
  const fallbacks = snap.workers.filter((w) => w.draft_fallback).map((w) =>
    el("p", {class: "fallback-note", "data-worker": w.worker_id},
       `${w.worker_id}: draft ${w.draft_fallback.draft} cannot run here: ${w.draft_fallback.reason}; ` +
       `drafting with ${w.draft_fallback.serving} instead`));
  document.getElementById("drafts").replaceChildren(...notes, ...(drafts.length
    ? [el("table", {class: "workers"},
        el("thead", {}, el("tr", {}, ...["worker", "draft queue", "draft", "sessions", "Redis RTT",
          "round trip p50 / p99", "blocks ahead",
          "resent / failed over", "beat", ""].map((h) => el("th", {}, h)))),
        el("tbody", {}, ...drafts.map((w) => el("tr", {"data-worker": w.worker_id},
          el("td", {class: "id"}, w.worker_id), el("td", {}, `draft.${w.pool}`), el("td", {class: "draft"}, w.model),
          el("td", {}, w.num_sessions), ...linkCells(w.link), el("td", {}, `${fmt.num(w.age_s)} s`),
          el("td", {class: "flags"}, ...(w.draft_fallback ? [fallbackBadge(w)] : [])))))),
       ...fallbacks]
    : [...(local.length ? [] : [el("p", {class: "muted"}, "no draft worker is heartbeating")]), ...fallbacks]));
}

function renderChildren(snap) {
  const section = document.getElementById("children-panel");
  section.hidden = !snap.children.length;
  document.getElementById("children").replaceChildren(...snap.children.map((c) =>
    el("tr", {"data-child": c.name, class: `child ${c.state}`},
      el("td", {class: "id"}, c.name), el("td", {class: "state"}, c.state), el("td", {}, c.pid || "-"),
      el("td", {}, c.restarts), el("td", {}, c.last_exit || "-"),
      el("td", {class: "detail"}, c.detail || (c.fallback ? `restarted with ${c.fallback}` : "")))));
}

function minuteTicks(start, end) {
  const ticks = [];
  for (let m = 5; m >= 0; m--) ticks.push([end - m * 60, m ? `-${m}m` : "now"]);
  return ticks.filter(([t]) => t >= start);
}

function renderWeights(snap) {
  const end = snap.now, start = end - snap.window_s;
  const history = snap.routing_history;
  const current = snap.routing ? snap.routing.pool_weights : {};
  const pools = [...new Set([...history.flatMap((h) => Object.keys(h.pool_weights)), ...Object.keys(current)])].sort();
  const series = pools.map((pool) => {
    // a version without the pool (no live worker there yet, or any more) breaks its line
    const points = history.map((h) => [Math.max(h.t, start), h.pool_weights[pool] ?? null]);
    points.push([end, current[pool] ?? null]);
    return {name: pool, color: colorOf(pool), step: true, points};
  });
  const bands = [];
  let hotSince = null;
  for (const h of history) {
    if (h.hot_workers.length && hotSince === null) hotSince = h.t;
    if (!h.hot_workers.length && hotSince !== null) { bands.push([hotSince, h.t]); hotSince = null; }
  }
  if (hotSince !== null) bands.push([hotSince, end]);
  MirrorCharts.lineChart(document.getElementById("chart-weights"), {
    series, bands, xMin: start, xMax: end, yMin: 0, yMax: 1, yFormat: fmt.pct, xTicks: minuteTicks(start, end),
    empty: "no routing table yet (is the telemetry service running?)"});
  document.getElementById("legend-weights").replaceChildren(...pools.map((pool) => {
    const swatch = el("span", {class: "swatch"});
    swatch.style.background = colorOf(pool);
    return el("span", {class: "legend-item", "data-pool": pool}, swatch, `${pool} ${fmt.pct(current[pool])}`);
  }));
  const hot = snap.routing ? snap.routing.hot_workers : [];
  const note = document.getElementById("hot-note");
  note.hidden = !hot.length;
  note.textContent = hot.length ? `hot: ${hot.join(", ")}` : "";
}

function renderRates(snap) {
  const rows = snap.throughput;
  const start = rows.length ? rows[0].t : snap.now - 60, end = rows.length ? rows[rows.length - 1].t : snap.now;
  const ticks = [[start, "-60s"], [start + (end - start) / 2, "-30s"], [end, "now"]];
  const tps = rows.map((r) => [r.t, r.tokens_per_s]);
  MirrorCharts.lineChart(document.getElementById("chart-tps"), {
    series: [{name: "tokens/s", color: "#4e9af1", points: tps}], xMin: start, xMax: end, yMin: 0,
    yMax: MirrorCharts.niceMax(Math.max(10, ...tps.map(([, v]) => v))), yFormat: (v) => fmt.num(v, 0),
    xTicks: ticks});
  // seconds in which no request finished have no TTFT: the line joins the seconds that do
  const ttft = rows.filter((r) => r.ttft_ms !== null).map((r) => [r.t, r.ttft_ms]);
  MirrorCharts.lineChart(document.getElementById("chart-ttft"), {
    series: [{name: "ttft", color: "#f28e2b", points: ttft}], xMin: start, xMax: end, yMin: 0,
    yMax: MirrorCharts.niceMax(Math.max(100, ...ttft.map(([, v]) => v))), yFormat: (v) => fmt.num(v, 0),
    xTicks: ticks, empty: "no request finished in the last minute"});
}

function renderAcceptance(snap) {
  const bars = snap.acceptance_per_position.map((p) => ({
    label: String(p.position + 1), value: p.rate, color: "#59a14f",
    title: `position ${p.position + 1}: ${p.accepted} of ${p.drafted} drafted tokens accepted`}));
  MirrorCharts.barChart(document.getElementById("chart-acceptance"), {
    bars, yMin: 0, yMax: 1, yFormat: fmt.pct, empty: "no drafted tokens yet"});
}

function describe(event) {
  const d = event.detail || {};
  if (d.pool_weights) {
    return `v${d.version}: ` + Object.entries(d.pool_weights).map(([p, w]) => `${p} ${fmt.pct(w)}`).join(", ");
  }
  return Object.entries(d).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
}

function renderEvents(snap) {
  document.getElementById("events").replaceChildren(...snap.events.map((e) =>
    el("tr", {class: `event ${e.kind}`, "data-kind": e.kind},
      el("td", {}, new Date(e.at.endsWith("Z") || e.at.includes("+") ? e.at : e.at + "Z")
        .toLocaleTimeString([], {hour12: false})),
      el("td", {class: "kind"}, e.kind), el("td", {}, e.worker_id || ""), el("td", {}, describe(e)))));
}

function renderHeader(snap) {
  const s = snap.summary;
  document.getElementById("model").textContent = snap.gateway.model;
  document.getElementById("stat-version").textContent = snap.routing ? `v${snap.routing.version}` : "none";
  document.getElementById("stat-inflight").textContent = `${snap.gateway.inflight} / ${snap.gateway.max_inflight}`;
  document.getElementById("stat-tps").textContent = fmt.num(s.tokens_per_s);
  document.getElementById("stat-ttft").textContent = `${fmt.ms(s.ttft_ms_p50)} / ${fmt.ms(s.ttft_ms_p99)}`;
  document.getElementById("stat-accept").textContent = s.acceptance_rate === null ? "-"
    : `${fmt.pct(s.acceptance_rate)} (${fmt.num(s.mean_acceptance_length, 2)} tok/round)`;
  document.getElementById("stat-suffix").textContent = s.suffix_share === null ? "-"
    : `${fmt.pct(s.suffix_share)} of rounds` + (s.history_share === null ? "" : ` (${fmt.pct(s.history_share)} history)`);
}

function setConn(text, kind) {
  const conn = document.getElementById("conn");
  conn.textContent = text;
  conn.className = `conn ${kind}`;
}

function render(snap) {
  renderHeader(snap);
  renderPools(snap);
  renderChildren(snap);
  renderWeights(snap);
  renderRates(snap);
  renderAcceptance(snap);
  renderEvents(snap);
  document.body.dataset.routingVersion = snap.routing ? snap.routing.version : "0";
  setConn(`live · ${fmt.clock(snap.now)}`, "ok");
}

async function poll() {
  if (waitingForKey) return;
  try {
    const key = sessionStorage.getItem(KEY_STORE);
    const response = await fetch("v1/dashboard", {headers: key ? {Authorization: `Bearer ${key}`} : {},
                                                   cache: "no-store"});
    if (response.status === 401) {
      waitingForKey = true;
      document.getElementById("key-form").hidden = false;
      setConn(key ? "key refused" : "API key needed", "error");
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (err) {
    setConn(`no data: ${err.message}`, "error");
  }
  setTimeout(poll, POLL_MS);
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORE, document.getElementById("key-input").value.trim());
  document.getElementById("key-form").hidden = true;
  waitingForKey = false;
  poll();
});

poll();
