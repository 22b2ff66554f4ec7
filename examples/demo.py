"""`make demo`: the embedded default, running, telling its story within a minute.

Creates the demo staff user once, starts the web server (daphne: dashboard + admin), two `db`
workers and the timer poller as child processes, then keeps work moving: checkout runs all the
time, a burst of 20 partner calls into the throttled queue every minute (backlog and
backpressure on the flow view), an invoice import that fails during a partner outage (retry it
from its page), an order waiting for the signal `approve`, and with every burst: a start quota
refusing a third chat turn (logged here; "Start quotas" on the overview counts it) and customer
exports under per-key step concurrency (one step per customer executes at a time; the others'
timelines show their queue wait). Ctrl-C stops everything once, gracefully (workers drain).

Options (environment): DEMO_PORT (default 8000; `make demo PORT=8001`), DEMO_HOST.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST = os.environ.get("DEMO_HOST", "127.0.0.1")
USERNAME, PASSWORD = "demo", "demo-password"
BURST_EVERY_S = 60
OUTAGE_S = 90
TENANTS = ["acme", "globex", "initech", "umbrella"]


def port_from_env() -> int:
    raw = os.environ.get("DEMO_PORT") or "8000"
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise SystemExit(f"demo: PORT must be a TCP port number (1-65535), got {raw!r}")
    return int(raw)


def check_port_free(host: str, port: int) -> None:
    """Fail before anything starts if the port is taken (daphne would only log it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise SystemExit(
                f"demo: cannot listen on {host}:{port} ({exc.strerror}); is another server running? "
                f"Pick another port: make demo PORT={port + 1}"
            ) from None


def ensure_user() -> None:
    """Create the demo user once; a restart keeps whatever password it has now."""
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    if not user_model.objects.filter(username=USERNAME).exists():
        user_model.objects.create_superuser(USERNAME, password=PASSWORD)
        print(f"  created the staff user {USERNAME} / {PASSWORD}", flush=True)


def story_once() -> None:
    """The runs a visitor finds at once: a failure to retry, a run waiting for a signal."""
    from durable_flow import start

    start("examples.approval", {"order_id": 1001}, run_id=f"approve-order-{int(time.time())}")
    start("examples.invoice_import", {"batch": "2026-12", "down_until": time.time() + OUTAGE_S})


def burst() -> None:
    from durable_flow import start
    from durable_flow_dashboard.flow import burst_config, burst_inputs

    config = burst_config()
    for payload in burst_inputs(config["SIZE"]):
        start(config["WORKFLOW"], payload, tags=["burst"])


def chat_turns() -> None:
    """Three chat turns for one tenant whose quota is two: the third is refused at once."""
    from durable_flow import start
    from durable_flow.exceptions import ConcurrencyLimitError

    for i in range(3):
        try:
            start("examples.chat_turn", {"tenant": "acme", "prompt": f"hello {i}"})
        except ConcurrencyLimitError as exc:
            print(f"  quota refused a start: {exc}", flush=True)


def customer_exports() -> None:
    """Two exports for one customer and one for another: the first customer's six steps take
    turns one at a time (`concurrency={"limit": 1, "key": "input.customer_id"}`), the other's
    three run beside them."""
    from durable_flow import start

    stamp = int(time.time())
    for n, customer in enumerate(["cust-7", "cust-7", "cust-9"]):
        start("examples.customer_export", {"customer_id": customer}, run_id=f"export-{customer}-{stamp}-{n}")
    print(
        "  per-key step concurrency: 2 exports for cust-7 (one step at a time) and 1 for cust-9 "
        "(see /dashboard/runs/?workflow=examples.customer_export)",
        flush=True,
    )


def main() -> int:
    port = port_from_env()
    check_port_free(HOST, port)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings.embedded")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from durable_flow import start
    from durable_flow.engine import get_engine

    ensure_user()
    get_engine().persist_queues()

    python = sys.executable
    # Each child in its own session: Ctrl-C in the terminal reaches only this process, which
    # then asks every child to stop exactly once (a second signal would skip the workers' drain).
    commands = [
        [python, "-m", "daphne", "-b", HOST, "-p", str(port), "settings.asgi:application"],
        [python, "manage.py", "durable_worker"],
        [python, "manage.py", "durable_worker", "--concurrency", "adaptive"],
        [python, "manage.py", "durable_poller"],
    ]
    children = [subprocess.Popen(command, cwd=ROOT, start_new_session=True) for command in commands]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    exit_code = 0
    if not wait_listening(HOST, port, children[0]):
        print(f"demo: the web server did not start on {HOST}:{port}; stopping", file=sys.stderr)
        stopping, exit_code = True, 1
    else:
        print(
            f"\n  durable_flow demo: dashboard http://{HOST}:{port}/   runs http://{HOST}:{port}/dashboard/runs/\n"
            f"  flow view http://{HOST}:{port}/dashboard/flow/   admin http://{HOST}:{port}/admin/\n"
            f"  log in as {USERNAME} (password {PASSWORD} unless you changed it)   Ctrl-C stops everything\n",
            flush=True,
        )
        story_once()
    last_burst = 0.0
    tick = 0
    try:
        while not stopping:
            if any(child.poll() is not None for child in children):
                print("demo: a demo process exited; stopping", file=sys.stderr)
                exit_code = 1
                break
            if time.monotonic() - last_burst >= BURST_EVERY_S:
                burst()
                chat_turns()  # two start, the third is refused (each chat holds its quota ~20 s)
                customer_exports()
                last_burst = time.monotonic()
            start("examples.checkout", random.randint(1, 10_000))
            if tick % 5 == 0:
                start("examples.nightly_sync", TENANTS)
            tick += 1
            for _ in range(30):
                if stopping:
                    break
                time.sleep(0.1)
    finally:
        stop_children(children)
    return exit_code


def wait_listening(host: str, port: int, server: subprocess.Popen[bytes], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        with socket.socket() as sock:
            if sock.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.2)
    return False


def stop_children(children: list[subprocess.Popen[bytes]]) -> None:
    """One SIGTERM each, then wait for the workers' drain (their --grace is 30 s)."""
    print("demo: stopping (workers finish their steps)…", flush=True)
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=35)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    print("demo stopped", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
