"""`make demo`: the embedded default, running.

Creates a demo staff user, starts the web server (daphne: admin + live dashboard), two `db`
workers and the timer poller as child processes, then keeps starting example workflows so
something visibly moves through the queues. Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST, PORT = os.environ.get("DEMO_HOST", "127.0.0.1"), os.environ.get("DEMO_PORT", "8000")
USERNAME, PASSWORD = "demo", "demo-password"


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings.embedded")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.contrib.auth import get_user_model

    from durable_flow import start
    from durable_flow.engine import get_engine

    user_model = get_user_model()
    user, _ = user_model.objects.get_or_create(username=USERNAME, defaults={"is_staff": True, "is_superuser": True})
    user.is_staff = user.is_superuser = True
    user.set_password(PASSWORD)
    user.save()
    get_engine().persist_queues()

    python = sys.executable
    children = [
        subprocess.Popen([python, "-m", "daphne", "-b", HOST, "-p", PORT, "settings.asgi:application"], cwd=ROOT),
        subprocess.Popen([python, "manage.py", "durable_worker"], cwd=ROOT),
        subprocess.Popen([python, "manage.py", "durable_worker", "--concurrency", "adaptive"], cwd=ROOT),
        subprocess.Popen([python, "manage.py", "durable_poller"], cwd=ROOT),
    ]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(
        f"\n  durable_flow demo: dashboard http://{HOST}:{PORT}/   admin http://{HOST}:{PORT}/admin/\n"
        f"  log in as {USERNAME} / {PASSWORD}   (Ctrl-C stops the server, workers and poller)\n",
        flush=True,
    )
    tenants = ["acme", "globex", "initech", "umbrella"]
    started = 0
    try:
        while not stopping:
            if any(child.poll() is not None for child in children):
                print("a demo process exited; stopping", file=sys.stderr)
                break
            start("examples.checkout", random.randint(1, 10_000))
            for tenant in random.sample(tenants, 2):
                start("examples.sync_tenant", {"tenant": tenant, "priority": random.choice([0, 0, 10])})
            if started % 5 == 0:
                start("examples.nightly_sync", tenants)
            started += 1
            for _ in range(30):
                if stopping:
                    break
                time.sleep(0.1)
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=35)
            except subprocess.TimeoutExpired:
                child.kill()
        print("demo stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
