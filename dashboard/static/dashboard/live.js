// The dashboard's live updates. Pages render complete on the server; this script subscribes
// to the page's topic (body[data-live-topic]) on /ws/live/ and swaps in the fragments each
// tick pushes (on joining, every fragment once; then only those that changed). When the socket drops it dims the numbers, says "disconnected" and reconnects
// with backoff; when the session has expired it says so and links to the login.
(function () {
  "use strict";
  const body = document.body;
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
      box.innerHTML = html;
      shown.set(box, html);
      if (active) box.querySelector(active)?.focus();
    }
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
