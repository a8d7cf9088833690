// The inferd console: tabs over /console/api/*, the Now tab live over server-sent events (/console/events).
// Text goes into the page as text nodes only (never innerHTML), so nothing a tenant names runs as markup.
"use strict";

const CSRF = document.querySelector('meta[name="csrf-token"]').content;
const ROLE = document.querySelector('meta[name="console-role"]').content;
const TABS = [...document.querySelectorAll("nav a[data-tab]")].map(a => a.dataset.tab);  // a member: its tenant's

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v); else node.setAttribute(k, v);
  }
  for (const c of children.flat()) node.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return node;
}

function table(headers, rows, id) {
  return el("table", id ? {id} : {}, el("thead", {}, el("tr", {}, headers.map(h => el("th", {}, h)))),
            el("tbody", {}, rows.map(r => el("tr", {}, r.map(c => el("td", {}, c))))));
}

const ms = s => (s === null || s === undefined) ? "–" : `${(s * 1000).toFixed(s < 0.1 ? 1 : 0)} ms`;
const num = (x, d = 0) => (x === null || x === undefined) ? "–" : Number(x).toFixed(d);
const when = t => t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) + "Z" : "–";
const pct = x => (x === null || x === undefined) ? "–" : `${(100 * x).toFixed(1)} %`;
const usd = x => `$${Number(x || 0).toFixed(4)}`;

async function api(path, options) {
  const r = await fetch(path, Object.assign({credentials: "same-origin"}, options || {}));
  if (r.status === 401) { location.assign("/console"); throw new Error("signed out"); }
  const body = await r.json();
  if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
  return body;
}

function post(path, body) {
  return api(path, {method: "POST", headers: {"content-type": "application/json", "x-csrf-token": CSRF},
                    body: JSON.stringify(body || {})});
}

function replace(id, ...nodes) { document.getElementById(id).replaceChildren(...nodes); }

// Now

function renderNow(snap) {
  const cards = snap.deployments.map(d => {
    const states = {};
    for (const r of d.replicas) states[r.state] = (states[r.state] || 0) + 1;
    const queues = Object.entries(d.queues).map(([cls, q]) => `${cls}: ${q.length} (oldest ${ms(q.oldest_age_s)})`);
    const failures = Object.entries(d.last_5m.failures).map(([k, n]) => `${k} ${n}`);
    return el("div", {class: "card", "data-deployment": d.name, "data-version": d.version},
      el("h2", {}, `${d.name} `, el("small", {}, `${d.version} · ${d.kind}${d.canary ? " · canary" : ""}`),
         el("span", {class: d.servable ? "ok" : "bad"}, d.servable ? " servable" : " not servable")),
      table(["replicas", "in flight", "requests/s", "queues", "failures (5 min)", "KV cache"],
            [[Object.entries(states).map(([s, n]) => `${n} ${s}`).join(", ") || "none",
              String(d.inflight), num(d.requests_per_s, 2), queues.join("; ") || "empty",
              failures.join(", ") || "none", pct(d.kv_cache_usage)]]),
      table(["window", "requests", "prefix-cache hits", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95", "E2E p50",
             "E2E p95"],
            ["last_5m", "last_60m"].map(w => [w.replace("last_", ""), String(d[w].requests),
                                              pct(d[w].prefix_cache_hit_rate), ms(d[w].ttft_p50_s), ms(d[w].ttft_p95_s),
                                              ms(d[w].tpot_p50_s), ms(d[w].tpot_p95_s), ms(d[w].e2e_p50_s),
                                              ms(d[w].e2e_p95_s)])),
      el("p", {class: "detail"},
         d.replicas.map(r => `${r.name}: ${r.state} (${r.inflight} in flight)`).join(" · "),
         d.cold_start_s ? ` · cold start ≈ ${num(d.cold_start_s, 1)} s` : "",
         d.autoscaler ? ` · autoscaler: ${d.autoscaler.desired} (${d.autoscaler.reason})` : "",
         d.degradation_level ? ` · degradation step ${d.degradation_level}` : "",
         d.sessions_open !== null ? ` · robot sessions open: ${d.sessions_open}` : ""));
  });
  replace("now", el("p", {class: "meta", id: "now-updated"}, `gateway ${snap.gateway_id} · updated ${when(snap.at_unix_s)}`
                    + ` · usage records pending ${snap.usage_records_pending}`), ...cards);
}

function watchNow() {
  const events = new EventSource("/console/events");
  events.addEventListener("now", e => renderNow(JSON.parse(e.data)));
  events.addEventListener("signed-out", () => { events.close(); location.assign("/console"); });
}

// Tenants and keys

async function loadTenants(shown) {
  const data = await api("/console/api/tenants");
  const tenants = table(["tenant", "limits", "budget", "spent this period", "period from", "models"],
    data.tenants.map(t => [t.name, JSON.stringify(t.limits), t.budget_usd === null ? "none" : usd(t.budget_usd),
                           usd(t.spent_usd), when(t.period_start_unix_s), t.allowed_models ? t.allowed_models.join(", ") : "all"]),
    "tenant-table");
  const keys = table(["key", "name", "tenant", "created", "revoked", ""], data.keys.map(k => [k.id, k.name, k.tenant,
    when(k.created_unix_s), when(k.revoked_unix_s),
    (ROLE === "admin" && !k.revoked_unix_s) ? el("button", {class: "revoke", "data-key": k.id,
      onclick: () => revoke(k.id)}, "Revoke") : ""]), "key-table");
  const form = ROLE !== "admin" ? el("p", {}, "Read-only session: keys cannot be changed here.") :
    el("form", {id: "new-key", onsubmit: createKey},
       el("select", {id: "new-key-tenant"}, data.tenants.map(t => el("option", {value: t.name}, t.name))),
       el("input", {id: "new-key-name", placeholder: "key name"}), el("button", {type: "submit", id: "create-key"}, "Create key"));
  const audit = data.audit ? [el("h2", {}, "Audit log"), table(["when", "who", "what", "target"],
    data.audit.map(a => [when(a.at_unix_s), a.actor, a.action, a.target]))] : [];
  replace("tenants", el("h2", {}, "Tenants"), tenants, el("h2", {}, "Keys"), form, shown || "", keys, ...audit);
}

async function createKey(e) {
  e.preventDefault();
  const made = await post("/console/api/keys", {tenant: document.getElementById("new-key-tenant").value,
                                                name: document.getElementById("new-key-name").value});
  await loadTenants(el("p", {class: "new-key"}, "New key (shown once, store it now): ",
                       el("code", {id: "new-key-value"}, made.key), ` (${made.id})`));
}

async function revoke(id) {
  await post(`/console/api/keys/${encodeURIComponent(id)}/revoke`);
  await loadTenants(el("p", {class: "notice", id: "revoked"}, `revoked ${id}`));
}

// Usage

async function loadUsage(e) {
  if (e) e.preventDefault();
  const form = document.getElementById("usage-form") || el("form", {id: "usage-form", onsubmit: loadUsage},
    el("label", {}, "since ", el("input", {type: "date", id: "usage-since"})),
    el("label", {}, " until ", el("input", {type: "date", id: "usage-until"})),
    el("label", {}, " tenant ", el("input", {id: "usage-tenant", placeholder: "all"})),
    el("button", {type: "submit"}, "Show"), el("a", {id: "usage-csv", href: "/console/usage.csv"}, "CSV"));
  const params = new URLSearchParams();
  for (const k of ["since", "until", "tenant"]) {
    const v = document.getElementById(`usage-${k}`) && document.getElementById(`usage-${k}`).value;
    if (v) params.set(k, v);
  }
  const data = await api(`/console/api/usage?${params}`);
  form.querySelector("#usage-csv").href = `/console/usage.csv?${params}`;
  replace("usage", form, el("p", {class: "meta", id: "usage-took"}, `${data.data.length} rows in ${num(data.query_ms, 1)} ms`),
    table(["day", "tenant", "model", "class", "requests", "rejected", "failed", "cancelled", "expired", "prompt",
           "cached", "completion", "cost"],
          data.data.map(r => [r.date, r.tenant, r.model, r.priority_class || "–", String(r.requests), String(r.rejected),
                              String(r.failed), String(r.cancelled), String(r.expired), String(r.prompt_tokens),
                              String(r.cached_tokens), String(r.completion_tokens), usd(r.cost_usd)]), "usage-table"),
    ...(data.not_completed_24h ? [el("h2", {}, "Not completed in the last 24 h, by reason"),
      table(["model", "version", "reason", "requests"], data.not_completed_24h.map(r => [r.model, r.version, r.reason,
            String(r.count)]), "reasons-table")] : []));
}

// History: one chart per figure, by uPlot (vendored in static/, uplot.LICENSE): a time axis, the unit on the value
// axis, the values under the cursor in the legend, and the SLO as a dashed line where there is one

function chart(title, unit, span, points, key, scale, slo) {
  // the window's two ends as points of their own, so that the time axis is the window and the SLO spans it
  const figure = el("figure", {class: "chart", "data-figure": key});
  const end = Date.now() / 1000, xs = [end - span, ...points.map(p => p.start_unix_s), end];
  const data = [xs, [null, ...points.map(p => (p[key] === null || p[key] === undefined) ? null : p[key] * (scale || 1)),
                     null]];
  const shown = (u, v) => (v === null || v === undefined) ? "–" : `${Number(v.toPrecision(3))} ${unit}`;
  const series = [{value: (u, t) => t ? when(t) : "–"},
                  {label: title, stroke: "#2b6cb0", width: 1.5, value: shown, spanGaps: false}];
  if (slo !== undefined) {
    data.push(xs.map(() => slo));
    series.push({label: "SLO", stroke: "#c53030", dash: [6, 4], width: 1, value: shown, points: {show: false}});
  }
  const top = Math.max(0, ...data[1].filter(v => v !== null), slo || 0);
  const nearest = (u, s, i) => {  // the cursor rests on the nearest point that has a value (not a window's end)
    for (let d = 0; d < xs.length; d++) {
      if (data[1][i - d] != null) return i - d;
      if (data[1][i + d] != null) return i + d;
    }
    return i;
  };
  new uPlot({width: 360, height: 170, series, cursor: {drag: {x: false, y: false}, dataIdx: nearest},
             scales: {x: {time: true, range: () => [xs[0], end]}, y: {range: () => [0, top > 0 ? top * 1.15 : 1]}},
             axes: [{}, {label: unit, labelSize: 14, size: 52}]}, data, figure);
  return figure;
}

const SLO = {ttft_p95_s: 2.0, tpot_p95_s: 0.2};  // as deploy/prometheus/alerts.yml and the Grafana dashboard

async function loadHistory() {
  const res = document.getElementById("history-minute") && document.getElementById("history-minute").checked;
  const data = await api(`/console/api/history${res ? "?resolution=minute" : ""}`);
  const toggle = el("label", {}, el("input", {type: "checkbox", id: "history-minute", onchange: loadHistory}),
                    " last hour by minute (else 24 h in 10-minute steps)");
  toggle.firstChild.checked = !!res;
  const span = res ? 3600 : 86400;
  replace("history", toggle, ...data.deployments.map(d => el("div", {class: "card"},
    el("h2", {}, `${d.name} `, el("small", {}, `${d.version} · ${d.points.length} points`)),
    chart("requests", "req/s", span, d.points, "requests_per_s"),
    chart("TTFT p95", "ms", span, d.points, "ttft_p95_s", 1000, SLO.ttft_p95_s * 1000),
    chart("TPOT p95", "ms", span, d.points, "tpot_p95_s", 1000, SLO.tpot_p95_s * 1000),
    chart("E2E p95", "ms", span, d.points, "e2e_p95_s", 1000),
    chart("KV cache", "%", span, d.points, "kv_cache_usage", 100),
    chart("queue length (max)", "requests", span, d.points, "queue_length_max"),
    chart("in flight (max)", "requests", span, d.points, "inflight_max"),
    chart("not completed", "requests", span, d.points, "failures"))));
}

// Rollouts and autoscaling

const ACTIONS = {pending: ["start", "promote", "rollback"], running: ["promote", "rollback"]};
const LABELS = {start: "Start", promote: "Promote", rollback: "Roll back"};

function evidence(r) {
  // stable first, then the canary: the figures the decision is made on, over the rollout's window
  const rows = Object.entries(r.versions).sort(([, a], [, b]) => a.role === "stable" ? -1 : b.role === "stable" ? 1 : 0);
  return table(["version", "role", "replicas", "requests", "errors", "error rate", "TTFT p95", "TPOT p95",
                "cost / request", "probe score", "quality"],
    rows.map(([v, s]) => [v, s.role, String(s.replicas_alive), String(s.requests), String(s.errors), pct(s.error_rate),
                          ms(s.ttft_p95_s), ms(s.tpot_p95_s),
                          s.cost_per_request_usd === null ? "–" : `$${s.cost_per_request_usd.toPrecision(3)}`,
                          pct(s.probe_score), s.quality ? JSON.stringify(s.quality) : "–"]));
}

function rolloutCard(r) {
  const buttons = ROLE !== "admin" ? [] : (ACTIONS[r.state] || []).map(a => el("button",
    {class: `rollout-${a}`, "data-rollout": r.name, onclick: () => act(r.name, a)}, LABELS[a]));
  return el("div", {class: "card rollout", "data-rollout": r.name},
    el("h2", {}, `${r.name} `, el("small", {}, `stable ${r.stable_version} · canary ${r.canary_version}`),
       el("span", {class: `state ${r.state}`, id: `rollout-state-${r.name}`}, ` ${r.state}`)),
    el("p", {class: "detail"}, `weight ${num(r.weight, 2)} · window ${num(r.window_s)} s, at least ${r.min_requests} canary`
       + ` requests · ${r.auto ? "decides itself" : "the operator decides"} · started ${when(r.started_unix_s)}`),
    evidence(r),
    el("p", {class: "decision"}, `decision: ${r.decision.action}${r.decision.by ? ` (${r.decision.by}, ${when(r.decision.at_unix_s)})` : ""}: `,
       r.decision.reasons.join("; ")),
    buttons.length ? el("p", {class: "actions"}, buttons) : "");
}

async function act(name, action) {
  if (action !== "start" && !confirm(`${LABELS[action]} the canary of ${name}?`)) return;
  await post(`/console/api/rollouts/${encodeURIComponent(name)}/${action}`);
  await loadRollouts();
}

async function loadRollouts() {
  const data = await api("/console/api/rollouts");
  replace("rollouts", el("h2", {}, "Canary rollouts"), ...(data.rollouts.length ? data.rollouts.map(rolloutCard)
      : [el("p", {}, "No canaries (a deployment with role: canary in inferd serve --config).")]),
    el("h2", {}, "Autoscaling"), ...(data.autoscaling.length ? data.autoscaling.map(autoscalerCard)
      : [el("p", {}, "No deployment has an autoscaling spec.")]));
}

function autoscalerCard(a) {
  // the last decision and its signals, then the recent decisions (newest first) with their reasons
  const s = a.signals || {};
  return el("div", {class: "card", "data-autoscaler": a.name},
    el("h3", {}, `${a.name} ${a.version} · target ${a.target} replicas`),
    el("p", {class: "meta"}, a.decision ? `now: ${a.decision.desired} (${a.decision.reason})` : "no decision yet",
       a.signals ? ` · queue ${s.queue_length} (oldest ${ms(s.queue_age_s)}) · in flight ${s.inflight}`
                   + ` · KV ${pct(s.kv_usage)} · TTFT p95 ${ms(s.ttft_p95_s)} · cold start ${num(s.cold_start_s, 1)} s` : ""),
    table(["when", "replicas", "desired", "reason"], a.recent_decisions.map(d =>
      [when(d.at_unix_s), String(d.replicas), String(d.desired), d.reason]), `decisions-${a.name}`));
}

// tabs

const LOADERS = {tenants: () => loadTenants(), usage: () => loadUsage(), history: loadHistory, rollouts: loadRollouts};

function show() {
  const tab = TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : TABS[0];
  for (const t of TABS) {
    document.getElementById(t).hidden = t !== tab;
    document.querySelector(`nav a[data-tab="${t}"]`).classList.toggle("active", t === tab);
  }
  if (LOADERS[tab]) LOADERS[tab]().catch(err => replace(tab, el("p", {class: "error"}, String(err.message))));
}

window.addEventListener("hashchange", show);
show();
if (TABS.includes("now")) watchNow();
