"""What bench/rss.py, bench/history.py and bench/sqlite_processes.py share: a throwaway database
on the embedded default's backends (`db` transport, `db` admission), a SQLite file or a
PostgreSQL database, one-step no-op runs started up front, and real `durable_worker` processes
to run them (bench/transport.py's `steady_rate` and `stop` time and reap them)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import reporting  # noqa: E402
import services  # noqa: E402
from transport import steady_rate, stop  # noqa: E402,F401 - re-exported for the benches

WORKFLOW = "tests.slow_one"


@contextmanager
def sqlite_stack(name: str) -> Iterator[None]:
    """Django on `settings.test` with DEBUG off, a fresh var/ SQLite file of its own (deleted
    after) and the `db` transport, for this process and the workers it starts."""
    with db_stack(name, postgres=False):
        yield


@contextmanager
def postgres_stack(name: str) -> Iterator[None]:
    """The same on a fresh PostgreSQL database of its own (created here, dropped after)."""
    with db_stack(name, postgres=True):
        yield


@contextmanager
def db_stack(name: str, postgres: bool) -> Iterator[None]:
    test_id = f"bench-{name}-{os.getpid()}"
    database = f"durable_flow_bench_{name}_{os.getpid()}"
    os.environ.update(
        {
            "DURABLE_FLOW_TEST_ID": test_id,
            "DJANGO_SETTINGS_MODULE": "settings.test",
            "DURABLE_FLOW_TRANSPORT": "db",
            "DURABLE_FLOW_ADMISSION": "db",
            "DURABLE_FLOW_LOG": "WARNING",
            # As deployed: with DEBUG on, Django keeps each connection's last 9,000 queries, which
            # would read as a leak in bench/rss.py and cost time in bench/history.py.
            "DJANGO_DEBUG": "0",
        }
    )
    for variable in ("DATABASE_URL", "DURABLE_FLOW_SUBPROCESS", "DURABLE_FLOW_TEST_MARKER"):
        os.environ.pop(variable, None)
    files = [ROOT / "var" / f"test-{test_id}.sqlite3{suffix}" for suffix in ("", "-wal", "-shm")]
    if postgres:
        services.pg_admin(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        services.pg_admin(f"CREATE DATABASE {database}")
        os.environ["DATABASE_URL"] = f"{services.PG_SERVER}/{database}"
    else:
        for path in files:
            path.unlink(missing_ok=True)
    try:
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        yield
    finally:
        from django.db import connections

        connections.close_all()
        if postgres:
            services.pg_admin(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        for path in files:
            path.unlink(missing_ok=True)


def start_runs(prefix: str, count: int, queue: str | None = None) -> None:
    """`count` one-step no-op runs with ids `<prefix>-<n>`, pending for the workers; with
    `queue`, each step goes through that flow-control queue (`tests.queued`)."""
    from durable_flow import start

    shown = reporting.Progress(f"starting runs {prefix}", total=count, unit="runs")
    for i in range(count):
        if queue is None:
            start(WORKFLOW, {"id": i, "seconds": 0}, run_id=f"{prefix}-{i}")
        else:
            start("tests.queued", {"queue": queue, "id": i}, run_id=f"{prefix}-{i}")
        shown.update(i + 1)


def completed(prefix: str) -> int:
    """How many of the runs `start_runs(prefix, ...)` made have completed.

    This is polled every 10 ms, so it must not grow with the history bench/history.py adds: it
    reads the prefix's range of the primary key ('.' is the character after '-') and counts the
    statuses here. `id LIKE 'prefix-%'` scans the whole table, and with a `status` condition
    SQLite's planner (no ANALYZE) walks the status index over every completed run of history."""
    from durable_flow.models import RunStatus, WorkflowRun

    ours = WorkflowRun.objects.filter(id__gte=f"{prefix}-", id__lt=f"{prefix}.").order_by()
    return sum(status == RunStatus.COMPLETED for status in ours.values_list("status", flat=True))


def workers(count: int, concurrency: int) -> list[subprocess.Popen[bytes]]:
    """`count` `durable_worker` processes on this process's settings (stop them with `stop`)."""
    command = [sys.executable, str(ROOT / "manage.py"), "durable_worker", "--concurrency", str(concurrency)]
    return [
        subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)
    ]
