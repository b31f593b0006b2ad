// tollgate console. Hand-written, no build step, no dependencies.
//
// The admin token lives in this tab's sessionStorage and goes out as
// `Authorization: Bearer` on every call; there are no cookies, so a page
// elsewhere cannot make the browser act for the operator. Every value from
// the server reaches the page through textContent, never as HTML.
"use strict";

(function () {
  const PAGE = 50;
  const POLL_MS = 2000;
  const store = window.sessionStorage;
  const $ = (id) => document.getElementById(id);

  const view = { offset: 0, prefix: "", sort: "name", tenant: null, timer: null };

  // ---- talking to the admin API -------------------------------------------

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // A header value is bytes, and fetch refuses a character above U+00FF:
  // the name goes as its UTF-8 bytes, which the server reads as UTF-8.
  function utf8Bytes(text) {
    return Array.from(new TextEncoder().encode(text), (b) => String.fromCharCode(b)).join("");
  }

  async function api(method, path, body) {
    const headers = {
      Authorization: "Bearer " + store.getItem("tollgate.token"),
      "X-Tollgate-Client": "console",
    };
    const actor = store.getItem("tollgate.actor");
    if (actor) headers["X-Tollgate-Actor"] = utf8Bytes(actor);
    const init = { method, headers, cache: "no-store", credentials: "omit" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, "the worker did not answer (" + e.message + ")");
    }
    let data = null;
    try {
      data = await response.json();
    } catch (e) {
      data = null;
    }
    if (!response.ok) {
      const message = data && data.error ? data.error : response.status + " " + response.statusText;
      if (response.status === 401 && store.getItem("tollgate.token")) signOut(message);
      throw new ApiError(response.status, message);
    }
    return data;
  }

  // ---- small DOM helpers ---------------------------------------------------

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function show(id, on) {
    $(id).hidden = !on;
  }

  function say(id, message) {
    const node = $(id);
    node.textContent = message || "";
    node.hidden = !message;
  }

  function quotaText(q) {
    if (!q || !q.quota) return "default";
    return q.quota.rate + (q.quota.burst > 1 ? " burst " + q.quota.burst : "");
  }

  function effectiveText(q) {
    if (!q.adaptive) return "";
    const r = q.effective_rate_per_s;
    if (r == null) return "(learning)";
    // Per minute or per hour below one a second (a 1/h quota's 0.97/h, not 0.00/s).
    const [n, unit] = r >= 1 ? [r, "s"] : r * 60 >= 1 ? [r * 60, "m"] : [r * 3600, "h"];
    return String(Number(n.toFixed(2))) + "/" + unit;
  }

  function lagText(p95) {
    if (p95 == null) return "";
    if (typeof p95 === "string") return p95;
    return "≤ " + (p95 < 1 ? Math.round(p95 * 1000) + " ms" : p95 + " s");
  }

  function stateTags(q) {
    const cell = el("td");
    if (q.paused) cell.appendChild(el("span", "paused", "tag paused"));
    if (q.adaptive) cell.appendChild(el("span", "adaptive", "tag adaptive"));
    if (q.shadow) cell.appendChild(el("span", "shadow " + q.shadow.rate, "tag shadow"));
    return cell;
  }

  // ---- signing in and out --------------------------------------------------

  async function signIn(event) {
    event.preventDefault();
    say("login-error", "");
    const actor = $("login-actor").value.trim();
    if (!actor) {
      say("login-error", "Give your name: it goes into the audit with every change you make.");
      return;
    }
    store.setItem("tollgate.token", $("login-token").value);
    store.setItem("tollgate.actor", actor);
    try {
      await api("GET", "/v1/console/tenants?limit=1");
    } catch (e) {
      store.removeItem("tollgate.token");
      say("login-error", e.status === 401 ? "Sign-in refused: " + e.message : e.message);
      return;
    }
    $("login-token").value = "";
    enter();
  }

  function signOut(reason) {
    store.removeItem("tollgate.token");
    store.removeItem("tollgate.actor");
    clearInterval(view.timer);
    view.timer = null;
    show("whoami", false);
    show("tenants", false);
    show("shared", false);
    show("dlq", false);
    show("tenant", false);
    show("login", true);
    say("login-error", reason || "");
  }

  function enter() {
    $("actor-name").textContent = store.getItem("tollgate.actor");
    show("login", false);
    show("whoami", true);
    show("tenants", true);
    show("shared", true);
    show("dlq", true);
    refresh();
    view.timer = setInterval(refresh, POLL_MS);
  }

  // ---- the tenant list -----------------------------------------------------

  async function refresh() {
    try {
      await loadList();
      await loadShared();
      if (view.tenant) await loadTenant(view.tenant);
      $("live").textContent = "updated " + new Date().toLocaleTimeString();
      say("list-error", "");
    } catch (e) {
      say("list-error", e.message);
    }
  }

  // "12: quota 10, not due 2", from the parked copies by reason.
  function parkedText(parked) {
    const reasons = Object.keys(parked);
    const total = reasons.reduce((sum, r) => sum + parked[r], 0);
    if (!total) return "0";
    return total + ": " + reasons.map((r) => r.replace("_", " ") + " " + parked[r]).join(", ");
  }

  async function loadList() {
    const query = new URLSearchParams({
      prefix: view.prefix,
      sort: view.sort,
      offset: String(view.offset),
      limit: String(PAGE),
    });
    const page = await api("GET", "/v1/console/tenants?" + query);
    const body = $("tenant-table").tBodies[0];
    const rows = page.tenants.map((t) => {
      const row = el("tr");
      row.dataset.tenant = t.tenant;
      const name = el("td");
      const link = el("a", t.tenant);
      link.href = "#tenant=" + encodeURIComponent(t.tenant);
      name.appendChild(link);
      row.appendChild(name);
      const a = t.activity;
      row.appendChild(el("td", quotaText(t) + (t.concurrency == null ? "" : ", " + t.concurrency + " at once")));
      row.appendChild(el("td", effectiveText(t)));
      row.appendChild(el("td", a.sent_per_s_10s.toFixed(1) + " · " + a.sent_per_s_5m.toFixed(2)));
      row.appendChild(el("td", a.throttled_5m + " · " + a.failed_5m));
      row.appendChild(el("td", lagText(a.due_lag_p95_s)));
      row.appendChild(el("td", a.in_flight));
      row.appendChild(el("td", a.queued ? a.queued + " (" + a.queued_for_s.toFixed(1) + " s)" : "0"));
      row.appendChild(el("td", parkedText(a.parked)));
      row.appendChild(el("td", t.waiting, "why"));
      row.appendChild(stateTags(t));
      row.appendChild(el("td", t.updated_by || ""));
      return row;
    });
    body.replaceChildren(...rows);
    show("no-tenants", page.total === 0);
    const last = Math.min(page.offset + page.tenants.length, page.total);
    $("page-info").textContent = page.total ? page.offset + 1 + "–" + last + " of " + page.total : "";
    $("prev").disabled = page.offset === 0;
    $("next").disabled = last >= page.total;
    const fallback = page.default.quota;
    $("default-quota").textContent = fallback.rate + " burst " + fallback.burst + " (" + page.default.source + ")";
  }

  // ---- routes and the default quota -----------------------------------------

  async function loadShared() {
    const all = await api("GET", "/v1/shared-quotas");
    const rows = [];
    const row = (label, q) => {
      const tr = el("tr");
      tr.appendChild(el("td", label));
      tr.appendChild(el("td", quotaText(q)));
      tr.appendChild(el("td", effectiveText(q)));
      tr.appendChild(el("td", q.updated_by || ""));
      rows.push(tr);
    };
    row("default (" + all.default.source + ")", { quota: all.default.quota });
    for (const [route, q] of Object.entries(all.routes)) row("route " + route, q);
    $("route-table").tBodies[0].replaceChildren(...rows);
  }

  async function saveShared(event) {
    event.preventDefault();
    say("shared-error", "");
    say("shared-ok", "");
    const target = $("shared-target").value.trim();
    const body = { rate: $("shared-rate").value.trim(), burst: number("shared-burst") || 1 };
    if ($("shared-adaptive").checked) body.adaptive = {};
    const path = target === "default" ? "/v1/default-quota" : "/v1/routes/" + encodeURIComponent(target) + "/quota";
    try {
      await api("PUT", path, body);
    } catch (e) {
      say("shared-error", e.message);
      return;
    }
    say("shared-ok", "Saved: " + target + " " + body.rate);
    await refresh();
  }

  // ---- one tenant ----------------------------------------------------------

  function openTenant(name) {
    view.tenant = name;
    $("tenant-name").textContent = name || "(new)";
    $("quota-tenant").value = name || "";
    $("quota-tenant").readOnly = !!name;
    for (const id of ["quota-rate", "quota-concurrency", "quota-weight", "quota-min"]) $(id).value = "";
    $("quota-burst").value = "1";
    $("quota-adaptive").checked = false;
    say("quota-error", "");
    say("quota-ok", "");
    say("action-error", "");
    show("confirm-delete", false);
    show("tenant", true);
    $("tenant-settings").replaceChildren();
    $("history-table").tBodies[0].replaceChildren();
    if (name) loadTenant(name, true).catch((e) => say("action-error", e.message));
  }

  function closeTenant() {
    view.tenant = null;
    show("tenant", false);
    if (location.hash) history.replaceState(null, "", location.pathname);
  }

  async function loadTenant(name, fillForm) {
    let settings = null;
    try {
      settings = await api("GET", "/v1/tenants/" + encodeURIComponent(name) + "/quota");
    } catch (e) {
      if (e.status !== 404) throw e;
    }
    if (view.tenant !== name) return;
    const list = [];
    const add = (term, value) => list.push(el("dt", term), el("dd", value));
    if (settings) {
      add("quota", quotaText(settings));
      if (settings.adaptive) {
        add("adaptive", "min " + settings.adaptive.min + ", decrease " + settings.adaptive.decrease +
          ", increase " + settings.adaptive.increase + ", probe " + settings.adaptive.probe_s + " s");
        add("effective rate", effectiveText(settings));
      }
      add("concurrency", settings.concurrency == null ? "unlimited" : settings.concurrency);
      add("weight", settings.weight);
      add("paused", settings.paused ? "yes" : "no");
      add("shadow", settings.shadow ? settings.shadow.rate : "no");
      add("last changed", (settings.updated_at || "") + " by " + (settings.updated_by || "?"));
    } else {
      add("quota", "none stored: the default applies");
    }
    $("tenant-settings").replaceChildren(...list);
    if (fillForm && settings && settings.quota) {
      $("quota-rate").value = settings.quota.rate;
      $("quota-burst").value = settings.quota.burst;
      $("quota-concurrency").value = settings.concurrency == null ? "" : settings.concurrency;
      $("quota-weight").value = settings.weight;
      $("quota-adaptive").checked = !!settings.adaptive;
      $("quota-min").value = settings.adaptive ? settings.adaptive.min : "";
    }
    const entries = await api("GET", "/v1/history?limit=50&target=" + encodeURIComponent("tenant:" + name));
    if (view.tenant !== name) return;
    $("history-table").tBodies[0].replaceChildren(
      ...entries.map((h) => {
        const row = el("tr");
        row.appendChild(el("td", h.at));
        row.appendChild(el("td", h.action));
        row.appendChild(el("td", h.who));
        row.appendChild(el("td", h.detail ? "" : quotaText(h.old)));
        row.appendChild(el("td", h.detail || quotaText(h.new)));
        return row;
      })
    );
  }

  function number(id) {
    const raw = $(id).value.trim();
    return raw === "" ? undefined : Number(raw);
  }

  async function saveQuota(event) {
    event.preventDefault();
    say("quota-error", "");
    say("quota-ok", "");
    const name = $("quota-tenant").value.trim();
    const body = { rate: $("quota-rate").value.trim(), burst: number("quota-burst") || 1 };
    const concurrency = number("quota-concurrency");
    const weight = number("quota-weight");
    if (concurrency !== undefined) body.concurrency = concurrency;
    if (weight !== undefined) body.weight = weight;
    if ($("quota-adaptive").checked) {
      body.adaptive = {};
      const min = $("quota-min").value.trim();
      if (min) body.adaptive.min = min;
    }
    try {
      await api("PUT", "/v1/tenants/" + encodeURIComponent(name) + "/quota", body);
    } catch (e) {
      say("quota-error", e.message);
      return;
    }
    say("quota-ok", "Saved: " + name + " " + body.rate);
    if (view.tenant !== name) openTenant(name);
    await refresh();
  }

  async function act(method, suffix) {
    say("action-error", "");
    try {
      await api(method, "/v1/tenants/" + encodeURIComponent(view.tenant) + suffix);
    } catch (e) {
      say("action-error", e.message);
      return;
    }
    await refresh();
  }

  async function shadow(event) {
    event.preventDefault();
    say("action-error", "");
    try {
      await api("PUT", "/v1/tenants/" + encodeURIComponent(view.tenant) + "/shadow", {
        rate: $("shadow-rate").value.trim(),
      });
    } catch (e) {
      say("action-error", e.message);
      return;
    }
    await refresh();
  }

  async function cancelJob(event) {
    event.preventDefault();
    say("action-error", "");
    say("cancel-ok", "");
    const job = $("cancel-job").value.trim();
    try {
      await api("POST", "/v1/cancel", { tenant: view.tenant, job_id: job });
    } catch (e) {
      say("action-error", e.message);
      return;
    }
    say("cancel-ok", "Cancelled: job " + job + " is skipped when its turn comes.");
    await refresh();
  }

  // ---- dead letters --------------------------------------------------------

  // Errors of the action that led here stay on screen; a failed read adds its own.
  async function loadDlq() {
    let summary;
    try {
      summary = await api("GET", "/v1/dlq?limit=20");
    } catch (e) {
      say("dlq-error", e.message);
      return;
    }
    $("dlq-queue").textContent = summary.queue;
    $("dlq-depth").textContent = summary.depth + " dead letter(s) in " + summary.queue;
    $("dlq-counts").tBodies[0].replaceChildren(
      ...summary.counts.map((c) => {
        const row = el("tr");
        row.appendChild(el("td", c.reason));
        row.appendChild(el("td", c.tenant));
        row.appendChild(el("td", c.count));
        const cell = el("td");
        // "?": routed by something that is not a tenant; a replay would
        // only dead-letter them again.
        if (c.tenant !== "?") {
          const replay = el("button", "Replay these");
          replay.type = "button";
          replay.addEventListener("click", () => replayDlq({ reason: c.reason, tenant: c.tenant }));
          cell.appendChild(replay);
        }
        row.appendChild(cell);
        return row;
      })
    );
    $("dlq-newest").tBodies[0].replaceChildren(
      ...summary.newest.map((l) => {
        const row = el("tr");
        for (const value of [l.dead_at || "?", l.reason, l.tenant, l.job_id, l.detail]) {
          row.appendChild(el("td", value));
        }
        return row;
      })
    );
  }

  // A replay or purge that outlasts the request goes on to its end (202).
  function stillRunning(done) {
    return "The " + done.running + " is still running; the history will say what it did.";
  }

  async function replayDlq(filter) {
    say("dlq-ok", "");
    say("dlq-error", "");
    try {
      const done = await api("POST", "/v1/dlq/replay", filter);
      say("dlq-ok", done.running ? stillRunning(done) : "Replayed " + done.replayed + "; " + done.left + " left.");
    } catch (e) {
      say("dlq-error", e.message);
    }
    await loadDlq();
  }

  async function purgeDlq() {
    say("dlq-ok", "");
    say("dlq-error", "");
    try {
      const done = await api("POST", "/v1/dlq/purge", { confirm: $("dlq-confirm-name").value.trim() });
      say("dlq-ok", done.running ? stillRunning(done) : "Purged " + done.purged + ".");
      show("dlq-confirm", false);
    } catch (e) {
      say("dlq-error", e.message);
    }
    $("dlq-confirm-name").value = "";
    await loadDlq();
  }

  // ---- wiring --------------------------------------------------------------

  function fromHash() {
    const match = /^#tenant=(.+)$/.exec(location.hash);
    if (match && store.getItem("tollgate.token")) openTenant(decodeURIComponent(match[1]));
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", signIn);
    $("logout").addEventListener("click", () => signOut(""));
    const search = () => {
      if (view.prefix === $("search").value.trim()) return;
      view.prefix = $("search").value.trim();
      view.offset = 0;
      refresh();
    };
    $("search").addEventListener("input", search);
    $("search").addEventListener("change", search);
    $("sort").addEventListener("change", () => {
      view.sort = $("sort").value;
      view.offset = 0;
      refresh();
    });
    $("prev").addEventListener("click", () => {
      view.offset = Math.max(0, view.offset - PAGE);
      refresh();
    });
    $("next").addEventListener("click", () => {
      view.offset += PAGE;
      refresh();
    });
    $("new-quota").addEventListener("click", () => openTenant(null));
    $("close-tenant").addEventListener("click", closeTenant);
    $("quota-form").addEventListener("submit", saveQuota);
    $("pause").addEventListener("click", () => act("POST", "/pause"));
    $("resume").addEventListener("click", () => act("POST", "/resume"));
    $("delete-quota").addEventListener("click", () => show("confirm-delete", true));
    $("confirm-delete-no").addEventListener("click", () => show("confirm-delete", false));
    $("confirm-delete-yes").addEventListener("click", async () => {
      show("confirm-delete", false);
      await act("DELETE", "/quota");
    });
    $("shared-form").addEventListener("submit", saveShared);
    $("shadow-form").addEventListener("submit", shadow);
    $("shadow-clear").addEventListener("click", () => act("DELETE", "/shadow"));
    $("cancel-form").addEventListener("submit", cancelJob);
    $("dlq-refresh").addEventListener("click", () => {
      say("dlq-error", "");
      loadDlq();
    });
    $("dlq-replay-all").addEventListener("click", () => replayDlq({}));
    $("dlq-purge").addEventListener("click", async () => {
      await loadDlq();
      show("dlq-confirm", true);
    });
    $("dlq-confirm-no").addEventListener("click", () => show("dlq-confirm", false));
    $("dlq-confirm-yes").addEventListener("click", purgeDlq);
    window.addEventListener("hashchange", fromHash);
    if (store.getItem("tollgate.token")) {
      enter();
      fromHash();
    }
  });
})();
