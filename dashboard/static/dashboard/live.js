// The dashboard's live updates. Pages render complete on the server; this script subscribes
// to the page's topic (body[data-live-topic]) on /ws/live/ and swaps in the fragments each
// tick pushes (on joining, every fragment once; then only those that changed). When the socket drops it dims the numbers, says "disconnected" and reconnects
// with backoff; when the session has expired it says so and links to the login.
//
// What runs to now is drawn here, not sent: an element with data-since (a start, in ms since
// the epoch) shows the time since then, once a second, on the server's clock (the page's
// data-server-ms, then each tick's time), so a fragment holding a running duration stays the
// same from tick to tick and is not sent again. An input with data-live-at takes each tick's
// time (a form that confirms what the page showed says when it showed it). A name field with
// data-follow-awaited takes the first name #awaited-names offers, until the user types in it.
(function () {
  "use strict";
  const body = document.body;
  let skew = 0;  // the server's clock minus this browser's, in ms
  const served = document.querySelector("[data-server-ms]");
  if (served) skew = Number(served.dataset.serverMs) - Date.now();

  // The `duration` template filter's format: 1 ms below a second, then 12.3 s, 4 m 05 s, 2 h 03 m.
  function duration(seconds) {
    if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
    if (seconds < 60) return seconds < 10 ? `${seconds.toFixed(1)} s` : `${Math.round(seconds)} s`;
    const whole = Math.floor(seconds), minutes = Math.floor(whole / 60);
    if (minutes < 60) return `${minutes} m ${String(whole % 60).padStart(2, "0")} s`;
    return `${Math.floor(minutes / 60)} h ${String(minutes % 60).padStart(2, "0")} m`;
  }

  function clocks() {
    const now = Date.now() + skew;
    for (const el of document.querySelectorAll("[data-since]")) {
      el.textContent = duration(Math.max(0, now - Number(el.dataset.since)) / 1000);
    }
  }

  function followAwaited() {
    const first = document.getElementById("awaited-names")?.dataset.first;
    if (!first) return;
    for (const input of document.querySelectorAll("input[data-follow-awaited]")) {
      if (!input.dataset.typed && input !== document.activeElement) input.value = first;
    }
  }

  // A fragment is rendered for every tab alike, with no user: its POST forms carry no CSRF token
  // and its buttons no permission. The page has both (meta[name=csrf-token], body[data-perms]):
  // each form gets the token, and a button marked data-needs-perm="<app.codename>" is disabled
  // for a user without it (the server refuses the POST all the same).
  const csrf = document.querySelector('meta[name="csrf-token"]')?.content;
  const perms = new Set((body.dataset.perms || "").split(/\s+/).filter(Boolean));
  function fitToUser(root) {
    if (csrf) {
      for (const form of root.querySelectorAll('form[method="post" i]')) {
        if (form.querySelector('input[name="csrfmiddlewaretoken"]')) continue;
        const input = document.createElement("input");
        input.type = "hidden";
        input.name = "csrfmiddlewaretoken";
        input.value = csrf;
        form.prepend(input);
      }
    }
    for (const el of root.querySelectorAll("[data-needs-perm]")) {
      if (perms.has(el.dataset.needsPerm)) continue;
      el.disabled = true;
      el.title = `needs the ${el.dataset.needsPerm.split(".").pop()} permission`;
    }
  }

  // The run page's actions are all in the page; each is shown while the run's live state
  // (#run-state, data-run-<state>="true|false") holds the state its data-show-when names.
  function showByState() {
    const state = document.getElementById("run-state");
    if (!state) return;
    for (const el of document.querySelectorAll("[data-show-when]")) {
      const name = el.dataset.showWhen;
      el.hidden = state.dataset[`run${name[0].toUpperCase()}${name.slice(1)}`] !== "true";
    }
  }

  document.addEventListener("input", (event) => {
    if (event.target.matches?.("[data-follow-awaited]")) event.target.dataset.typed = "1";
  });
  clocks();
  setInterval(clocks, 1000);
  fitToUser(document);
  showByState();

  const topic = body.dataset.liveTopic;
  const status = document.getElementById("live-status");
  if (!topic || !status || !("WebSocket" in window)) return;
  const proto = location.protocol === "https:" ? "wss" : "ws";
  const url = `${proto}://${location.host}/ws/live/?topic=${encodeURIComponent(topic)}`;
  const minDelay = 500, maxDelay = 10000;
  const shown = new WeakMap();  // each live box's last fragment, so unchanged ones are left alone
  let delay = minDelay, lastTick = null, retryTimer = null;

  function setStatus(state, text, link) {
    status.dataset.state = state;
    status.textContent = text;
    if (link) {
      const a = document.createElement("a");
      a.href = link.href;
      a.textContent = link.text;
      status.append(" · ", a);
    }
  }

  function focusKey(el) {
    if (!el || el === document.body) return null;
    if (el.id) return `#${CSS.escape(el.id)}`;
    const href = el.getAttribute && el.getAttribute("href");
    return href ? `[href="${CSS.escape(href)}"]` : null;
  }

  function apply(fragments) {
    for (const [name, html] of Object.entries(fragments || {})) {
      const box = document.querySelector(`[data-live="${CSS.escape(name)}"]`);
      if (!box || shown.get(box) === html) continue;
      // Keep keyboard focus on the same link or control across the swap.
      const active = box.contains(document.activeElement) ? focusKey(document.activeElement) : null;
      // A <details> the user opened (with an id) stays open across the swap.
      const open = [...box.querySelectorAll("details[id][open]")].map((d) => d.id);
      box.innerHTML = html;
      shown.set(box, html);
      for (const id of open) {
        const details = box.querySelector(`#${CSS.escape(id)}`);
        if (details) details.open = true;
      }
      fitToUser(box);
      if (active) box.querySelector(active)?.focus();
    }
    showByState();
    clocks();
    followAwaited();
  }

  function ticked(at) {
    const ms = Date.parse(at || "");
    if (Number.isNaN(ms)) return;
    skew = ms - Date.now();
    for (const input of document.querySelectorAll("input[data-live-at]")) input.value = at;
  }

  function expired() {
    body.classList.add("stale");
    const next = encodeURIComponent(location.pathname + location.search);
    setStatus("expired", "session expired", { href: `${body.dataset.loginUrl}?next=${next}`, text: "log in again" });
  }

  async function afterDrop() {
    body.classList.add("stale");
    try {
      const answer = await fetch(body.dataset.sessionUrl, { credentials: "same-origin", redirect: "manual", cache: "no-store" });
      if (answer.status === 401 || answer.status === 403 || answer.type === "opaqueredirect") return expired();
    } catch (err) {
      // The server does not answer: it is down or restarting; keep trying.
    }
    const seconds = Math.round(delay / 100) / 10;
    setStatus("disconnected", `disconnected · retrying in ${seconds} s` + (lastTick ? ` · numbers from ${lastTick}` : ""));
    clearTimeout(retryTimer);
    retryTimer = setTimeout(connect, delay);
    delay = Math.min(maxDelay, delay * 2) * (0.85 + Math.random() * 0.3);
  }

  function connect() {
    let socket;
    try {
      socket = new WebSocket(url);
    } catch (err) {
      return afterDrop();
    }
    socket.onopen = () => { delay = minDelay; };
    socket.onmessage = (event) => {
      const message = JSON.parse(event.data);
      if (message.session === "expired") return;
      if (message.gone) {
        setStatus("disconnected", "this item no longer exists");
        return;
      }
      apply(message.fragments);
      ticked(message.at);
      body.classList.remove("stale");
      lastTick = new Date().toLocaleTimeString();
      setStatus("live", `live · ${lastTick}`);
    };
    socket.onclose = (event) => {
      if (event.code === 4401) return expired();
      // An unknown topic stays unknown: retrying would only repeat the refusal.
      if (event.code === 4400) return setStatus("disconnected", "no live updates for this page");
      // The server renders as many live pages as it will: try again later, not at once.
      if (event.code === 4429) delay = maxDelay;
      afterDrop();
    };
  }
  setStatus("connecting", "connecting…");
  connect();
})();
