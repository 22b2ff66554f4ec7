#!/usr/bin/env python
"""Do the operator surfaces (dashboard pages, the admin's run list, /metrics/, the poller's
sampling, the live tick) stay fast when PostgreSQL holds a production-sized history?

    .venv/bin/python bench/surfaces.py                 # a small history (--scale 0.02: ~20,000 runs)
    .venv/bin/python bench/surfaces.py --scale 1       # the full history (1,000,000 finished runs)
    DURABLE_FLOW_BENCH_SCALE=1 .venv/bin/python bench/surfaces.py
    .venv/bin/python bench/surfaces.py --scale 1 --reuse --database df_surfaces
                               # loads once and keeps it; the next such run times the kept history

Design. A database of its own (dropped after) is migrated, with the trigram index the docs
suggest for the search inside inputs added, two queues (`imports`, `exports`)
and two live worker heartbeats are registered, and one probe run (finished, with its two
steps and attempts, tagged `probe`) is inserted: the run page and the id search look for it.
The "empty" tables hold no history but a page's worth of each list (3,400 finished runs, so
that 3 % failed fill a page, 60 waiting, 10 sleeping): a page then renders as many rows with
and without the history, and the ratio is what the history costs. Every page and endpoint is
requested `--requests` times (after two warm-up requests) by Django's test client as a staff
user, with DEBUG off, and the median kept, of its wall time and of its statements' time: first
on those tables, then after the history is loaded with bulk SQL (`INSERT ... SELECT
generate_series`, then VACUUM ANALYZE, which autovacuum does in production). At `--scale 1`
the history is:

- 1,000,000 finished runs over 30 days (96 % completed, 3 % failed, 1 % cancelled; one in ten
  tagged `nightly`, one in ten tagged with its customer), two steps each: the first on
  `imports`, `exports` or no queue, the second on none: 2,000,000 checkpoints, and an attempt
  row per step plus a failed first attempt for one step in twenty (2,100,000 attempts);
- 100,000 runs waiting on the `imports` queue (running, their step parked `waiting`, and its
  waiter in the `db` admission backend's line: the bench runs on the embedded default, `db`
  admission);
- 10,000 runs sleeping (suspended, their sleep due tomorrow).

Printed per page: its median on empty tables, with the history, the ratio, the statements'
time with the history, and the verdict against the targets (at most 150 ms, and at most 3x the
empty time, or 30 ms for a page that takes under 10 ms empty). The host's load average is
printed too: on a shared host the wall times include waiting for a core. Then the poller's
sampling pass (`take_samples`, target <= 10 ms: its median and worst, and the CPU time of
the database server's process for it, which waiting for a core on a busy host does not
inflate) and the database time of one live tick per
open tab (the statements' time of `compute_tick` for one topic, measured by a statement wrapper
around the connection: target <= 20 ms). The database runs on the same host as the client, so a statement's time is its
server time plus a local round trip.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

PG_SERVER = "postgres://postgres@127.0.0.1:5432"
PG_DATABASE = f"durable_flow_bench_surfaces_{os.getpid()}"  # its own: other sessions may run this bench too

FINISHED = 1_000_000
WAITING = 100_000
SLEEPING = 10_000
#: The runs on the "empty" tables: enough to fill each list's page, the failed runs' too (3 % of them).
BASE_FINISHED, BASE_WAITING, BASE_SLEEPING = 3_400, 60, 10
PAGE_MS = 150.0
PAGE_RATIO = 3.0
SAMPLING_MS = 10.0
TICK_MS = 20.0
#: The table a `--reuse` run writes its history's scale to once loaded (absent: no complete load).
LOADED = "bench_surfaces_loaded"
PROBE = "0probe0000000000000000000000run1"
QUEUES = ("imports", "exports")
#: The search inside inputs reads a trigram index a deployment adds (docs: "At production size").
INPUT_INDEX = (
    "CREATE INDEX df_run_input_trgm ON durable_flow_workflowrun USING gin ((UPPER((input)::text)) gin_trgm_ops)"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scale",
        type=float,
        default=float(os.environ.get("DURABLE_FLOW_BENCH_SCALE", "0.02")),
        help="fraction of the full history (1 = 1,000,000 finished runs); default 0.02 or $DURABLE_FLOW_BENCH_SCALE",
    )
    parser.add_argument("--requests", type=int, default=9, help="timed requests per page (the median is printed)")
    parser.add_argument("--keep", action="store_true", help=f"keep the database ({PG_DATABASE}) after the bench")
    reporting.add_json_option(parser, "surfaces")
    parser.add_argument(
        "--database",
        default=PG_DATABASE,
        help="the PostgreSQL database's name (default: one of this process's own, dropped after the bench)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the database after the bench, and time with the history a kept one already holds "
        "(migrated again, loaded at the same scale by an earlier --reuse run) instead of loading it: "
        "the empty-table figures are then not measured",
    )
    return parser.parse_args()


def pg_admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(sql)


def setup_django(database: str, reuse: bool) -> float | None:
    """Point Django at `database` and migrate it. With `reuse` and a database an earlier `--reuse`
    run kept, return the scale of the history it holds; else the database is made anew (None)."""
    os.environ["DURABLE_FLOW_TEST_ID"] = "bench-surfaces"
    os.environ["DJANGO_SETTINGS_MODULE"] = "settings.test"
    os.environ["DURABLE_FLOW_ADMISSION"] = "db"  # the embedded default
    os.environ["DJANGO_DEBUG"] = "0"  # as in production: no query log, no debug context
    os.environ["DJANGO_ALLOWED_HOSTS"] = "testserver"  # the test client's host
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    reused = reuse and pg_exists(database)
    if not reused:
        pg_admin(f"DROP DATABASE IF EXISTS {database}")
        pg_admin(f"CREATE DATABASE {database}")
    os.environ["DATABASE_URL"] = f"{PG_SERVER}/{database}"

    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)  # a kept database gets the migrations added since
    from django.db import connection

    with connection.cursor() as cursor:
        if not reused:  # the optional index of the search inside inputs (docs)
            cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
            cursor.execute(INPUT_INDEX)
            return None
        found = None
        if LOADED in connection.introspection.table_names(cursor):
            cursor.execute(f"SELECT scale FROM {LOADED}")
            found = cursor.fetchone()
            cursor.execute("SELECT EXISTS (SELECT 1 FROM durable_flow_admissionwaiter)")
            if not cursor.fetchone()[0]:  # kept before the bench loaded the admission line
                with reporting.progress(f"  loading {WAITERS_LABEL}"):
                    cursor.execute(WAITERS_SQL, {"batch": "b"})
                    cursor.execute("VACUUM ANALYZE durable_flow_admissionwaiter")
    if found is None:
        raise SystemExit(f"{database} holds no complete history: run without --reuse, or name another database")
    return float(found[0])


def pg_exists(database: str) -> bool:
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchone() is not None


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- the history -----------------------------------------------------------------------------

RUN_COLUMNS = (
    "id, workflow, version, status, input, output, error, wake_at, tags, parent_id, parent_step_key, "
    "concurrency_key, concurrency_limit, step_concurrency, turns, created_at, updated_at, finished_at, "
    "rerun_of, start_key, debounce_until"
)
CHECKPOINT_COLUMNS = (
    "run_id, key, sequence, kind, name, status, input, output, error, attempt, max_attempts, queue, holds_slot, "
    'priority, fairness_key, "group", wake_at, timeout_s, child_run_id, worker, late_result, created_at, '
    "dispatched_at, finished_at, wait_cause"
)
ATTEMPT_COLUMNS = (
    "checkpoint_id, run_id, attempt, status, worker, dispatched_at, started_at, finished_at, retry_at, error, late, "
    "operator_retry_at"
)

#: (label, SQL) in order; `%(finished)s` etc. are the counts. Finished run i starts at
#: now - 30 days - aged_s + i * (30 days / finished), so the newest finished run is `aged_s`
#: seconds old (a moment here; bench/retention.py ages them past its retention).
#: The `db` admission backend's line: a waiter per call parked on a queue (a history kept by an
#: earlier `--reuse` run without it gets it when reused).
WAITERS_LABEL = "the db admission line of the waiting runs"
WAITERS_SQL = """
    INSERT INTO durable_flow_admissionwaiter
        (queue, ticket, priority, fairness_key, key_served, arrival, seen_ms, constrained, constraints)
    SELECT c.queue, c.run_id || '/' || c.key, 0, '', -1,
           (extract(epoch FROM c.created_at) * 1000)::bigint, (extract(epoch FROM c.created_at) * 1000)::bigint,
           false, '[]'::jsonb
    FROM durable_flow_stepcheckpoint AS c
    WHERE c.status = 'waiting' AND c.queue <> '' AND c.run_id LIKE %(batch)s || '%%'
    ON CONFLICT DO NOTHING
"""

HISTORY_SQL: list[tuple[str, str]] = [
    (
        "finished runs",
        f"""
        INSERT INTO durable_flow_workflowrun ({RUN_COLUMNS})
        SELECT left(%(batch)s || md5('finished' || i), 32),
               (ARRAY['orders.import', 'orders.export', 'reports.nightly'])[i %% 3 + 1], '1',
               CASE WHEN i %% 100 < 96 THEN 'completed' WHEN i %% 100 < 99 THEN 'failed' ELSE 'cancelled' END,
               jsonb_build_object('customer', 'cust-' || (i %% 1000), 'order', i),
               CASE WHEN i %% 100 < 96 THEN '{{"rows": 17}}'::jsonb END,
               CASE WHEN i %% 100 BETWEEN 96 AND 98
                    THEN '{{"type": "orders.ImportError", "message": "row 17: bad date"}}'::jsonb END,
               NULL,
               CASE WHEN i %% 10 = 0 THEN '["nightly"]'::jsonb
                    WHEN i %% 10 = 1 THEN jsonb_build_array('cust-' || (i %% 1000)) ELSE '[]'::jsonb END,
               NULL, '', NULL, NULL, '[]'::jsonb, 2, t.at, t.at + interval '1 second', t.at + interval '1 second',
               '', NULL, NULL
        FROM generate_series(0, %(finished)s - 1) AS i,
             LATERAL (SELECT now() - interval '30 days' - %(aged_s)s * interval '1 second'
                             + (i * 2592000.0 / %(finished)s) * interval '1 second' AS at) AS t
        """,
    ),
    (
        "their checkpoints",
        f"""
        INSERT INTO durable_flow_stepcheckpoint ({CHECKPOINT_COLUMNS})
        SELECT r.id, k::text, k, 'step', CASE k WHEN 0 THEN 'orders.fetch' ELSE 'orders.store' END,
               CASE WHEN k = 1 AND r.status = 'failed' THEN 'failed'
                    WHEN k = 1 AND r.status = 'cancelled' THEN 'cancelled' ELSE 'completed' END,
               NULL, '{{"ok": true}}'::jsonb, NULL, 1, 3,
               CASE WHEN k = 0 THEN (ARRAY['imports', 'exports', ''])[abs(hashtext(r.id)) %% 3 + 1] ELSE '' END,
               false, 0, '', '', NULL, NULL, '', 'bench-host:1', NULL,
               r.created_at + k * interval '400 ms', r.created_at + k * interval '400 ms' + interval '50 ms',
               r.created_at + k * interval '400 ms' + interval '300 ms', ''
        FROM durable_flow_workflowrun AS r, generate_series(0, 1) AS k
        WHERE r.status IN ('completed', 'failed', 'cancelled') AND r.id LIKE %(batch)s || '%%'
        """,
    ),
    (
        "their attempts",
        f"""
        INSERT INTO durable_flow_stepattempt ({ATTEMPT_COLUMNS})
        SELECT c.id, c.run_id, 1, c.status, c.worker, c.dispatched_at, c.dispatched_at, c.finished_at, NULL,
               CASE WHEN c.status = 'failed' THEN '{{"type": "orders.ImportError"}}'::jsonb END, false, NULL
        FROM durable_flow_stepcheckpoint AS c WHERE c.run_id LIKE %(batch)s || '%%'
        """,
    ),
    (
        "retried attempts",
        f"""
        UPDATE durable_flow_stepattempt SET attempt = 2
        WHERE checkpoint_id %% 20 = 0 AND run_id LIKE %(batch)s || '%%';
        INSERT INTO durable_flow_stepattempt ({ATTEMPT_COLUMNS})
        SELECT c.id, c.run_id, 1, 'failed', c.worker, c.dispatched_at - interval '2 s',
               c.dispatched_at - interval '2 s', c.dispatched_at - interval '1 s', c.dispatched_at,
               '{{"type": "TimeoutError"}}'::jsonb, false, NULL
        FROM durable_flow_stepcheckpoint AS c WHERE c.id %% 20 = 0 AND c.run_id LIKE %(batch)s || '%%'
        """,
    ),
    (
        "runs waiting on a queue",
        f"""
        INSERT INTO durable_flow_workflowrun ({RUN_COLUMNS})
        SELECT left(%(batch)s || md5('waiting' || i), 32), 'orders.import', '1', 'running',
               jsonb_build_object('customer', 'cust-' || (i %% 1000), 'order', i), NULL, NULL, NULL, '[]'::jsonb,
               NULL, '', NULL, NULL, '[]'::jsonb, 1, t.at, t.at, NULL, '', NULL, NULL
        FROM generate_series(0, %(waiting)s - 1) AS i,
             LATERAL (SELECT now() - interval '1 hour' + (i * 3000.0 / %(waiting)s) * interval '1 second' AS at) AS t;
        INSERT INTO durable_flow_stepcheckpoint ({CHECKPOINT_COLUMNS})
        SELECT r.id, '0', 0, 'step', 'orders.fetch', 'waiting', NULL, NULL, NULL, 0, 3, 'imports', false, 0,
               r.input ->> 'customer', '', NULL, NULL, '', '', NULL, r.created_at, NULL, NULL, 'cap'
        FROM durable_flow_workflowrun AS r WHERE r.status = 'running' AND r.id LIKE %(batch)s || '%%'
        """,
    ),
    (
        "runs sleeping",
        f"""
        INSERT INTO durable_flow_workflowrun ({RUN_COLUMNS})
        SELECT left(%(batch)s || md5('sleeping' || i), 32), 'reports.nightly', '1', 'suspended',
               jsonb_build_object('report', i), NULL, NULL, now() + interval '1 day', '["nightly"]'::jsonb,
               NULL, '', NULL, NULL, '[]'::jsonb, 1, now() - interval '2 hours', now() - interval '2 hours', NULL,
               '', NULL, NULL
        FROM generate_series(0, %(sleeping)s - 1) AS i;
        INSERT INTO durable_flow_stepcheckpoint ({CHECKPOINT_COLUMNS})
        SELECT r.id, '0', 0, 'sleep', 'sleep', 'dispatched', NULL, NULL, NULL, 0, 1, '', false, 0, '', '',
               r.wake_at, NULL, '', '', NULL, r.created_at, NULL, NULL, 'sleep'
        FROM durable_flow_workflowrun AS r WHERE r.status = 'suspended' AND r.id LIKE %(batch)s || '%%'
        """,
    ),
    (WAITERS_LABEL, WAITERS_SQL),
]


def load_history(
    batch: str, finished: int, waiting: int, sleeping: int, quiet: bool = False, aged_s: float = 0
) -> dict[str, int]:
    """Bulk-insert runs whose ids start with `batch` (and their checkpoints and attempts), then
    VACUUM ANALYZE; return the tables' row counts."""
    from django.db import connection

    counts: dict[str, Any] = {
        "batch": batch,
        "finished": finished,
        "waiting": waiting,
        "sleeping": sleeping,
        "aged_s": aged_s,
    }
    # One statement a phase: each shows its elapsed time while it runs (a heartbeat), not rows.
    shown = (lambda label: nullcontext()) if quiet else (lambda label: reporting.progress(f"  {label}"))
    with connection.cursor() as cursor:
        for number, (label, sql) in enumerate(HISTORY_SQL, 1):
            with shown(f"loading {label} ({number}/{len(HISTORY_SQL)})"):
                for statement in sql.split(";"):
                    if statement.strip():
                        cursor.execute(statement, counts)
        with shown("VACUUM ANALYZE"):
            for table in ("workflowrun", "stepcheckpoint", "stepattempt"):
                cursor.execute(f"VACUUM ANALYZE durable_flow_{table}")
    return table_rows()


def register_fixtures() -> None:
    """Two queues, two live workers and the probe run (finished, two steps, tagged)."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from durable_flow.models import (
        AttemptStatus,
        RunStatus,
        StepAttempt,
        StepCheckpoint,
        StepStatus,
        WorkerHeartbeat,
        WorkflowRun,
    )
    from durable_flow.operations.api import register_queue

    for name in QUEUES:
        register_queue(name, concurrency=4)
    now = timezone.now()
    for n in range(2):
        WorkerHeartbeat.objects.create(
            worker_id=f"bench-host:{n}",
            host="bench-host",
            pid=n,
            transport="db",
            queues=[],
            started_at=now,
            last_seen=now + timedelta(days=1),  # alive for the whole bench
            mode="fixed",
            live_limit=8,
            in_flight=0,
            rss_bytes=0,
            cpu_percent=0.0,
            throughput=0.0,
            tasks_done=0,
        )
    run = WorkflowRun.objects.create(
        id=PROBE,
        workflow="orders.import",
        status=RunStatus.COMPLETED,
        input={"customer": "cust-probe"},
        output={"rows": 1},
        tags=["probe"],
        finished_at=now,
    )
    for key in range(2):
        checkpoint = StepCheckpoint.objects.create(
            run=run,
            key=str(key),
            sequence=key,
            name="orders.fetch",
            status=StepStatus.COMPLETED,
            attempt=1,
            queue="imports" if key == 0 else "",
            dispatched_at=now,
            finished_at=now,
        )
        StepAttempt.objects.create(
            checkpoint=checkpoint, run=run, attempt=1, status=AttemptStatus.COMPLETED, started_at=now, finished_at=now
        )
    get_user_model().objects.create_superuser("bench", "bench@example.com", "bench")


# --- what is timed -----------------------------------------------------------------------------


def pages() -> list[tuple[str, str]]:
    """(label, URL) of every page and endpoint timed."""
    from django.urls import reverse

    runs = reverse("dashboard:runs")
    admin_runs = reverse("admin:durable_flow_workflowrun_changelist")
    return [
        ("dashboard overview", reverse("dashboard:index")),
        ("queues", reverse("dashboard:queues")),
        ("queue imports", reverse("dashboard:queue", args=["imports"])),
        ("flow view imports", reverse("dashboard:flow") + "?queue=imports"),
        ("flow.json imports", reverse("dashboard:flow_json") + "?queue=imports"),
        ("workers", reverse("dashboard:workers")),
        ("runs list", runs),
        ("runs list, page 2", None),  # the first page's "older" link, found at run time
        ("runs list, id search", f"{runs}?q={PROBE[:8]}"),
        ("runs list, tag filter (rare)", f"{runs}?tag=probe"),
        ("runs list, tag filter (common)", f"{runs}?tag=nightly"),
        ("runs list, inside inputs", f"{runs}?q=cust-probe&in_input=on"),
        ("runs list, status failed", f"{runs}?status=failed"),
        ("runs list, queue filter", f"{runs}?queue=imports"),
        ("run page", reverse("dashboard:run", args=[PROBE])),
        ("admin runs, default", admin_runs),
        ("admin runs, queue filter", f"{admin_runs}?queue=imports"),
        ("admin runs, status filter", f"{admin_runs}?status__exact=failed"),
        ("admin runs, search", f"{admin_runs}?q={PROBE[:8]}"),
        ("admin run page", reverse("admin:durable_flow_workflowrun_change", args=[PROBE])),
        ("/metrics/", reverse("metrics")),
    ]


def next_page_url(client: Any, url: str) -> str:
    """The "older" link of the run list's first page (keyset: its cursor names the last row)."""
    import re
    from urllib.parse import quote

    from durable_flow.models import WorkflowRun
    from durable_flow.observe.run_pages import cursor_of, position

    html = client.get(url).content.decode()
    found = re.search(r'href="([^"]*)" rel="next"', html)
    if not found:  # one page only (empty tables): the page after its newest run
        return f"{url}?after={quote(cursor_of(position(WorkflowRun.objects.order_by('-created_at').first())))}"
    return url + found.group(1).replace("&amp;", "&")


def timed(request: Callable[[], Any], times: int, warmup: int = 2) -> tuple[float, float]:
    """The medians of `request()`'s wall time and of its statements' time, in ms."""
    spent, in_db = timings(request, times, warmup)
    return statistics.median(spent), statistics.median(in_db)


def timings(request: Callable[[], Any], times: int, warmup: int = 2) -> tuple[list[float], list[float]]:
    """Each timed `request()`'s wall time and its statements' time, in ms (after `warmup`)."""
    spent, in_db = [], []
    for n in range(warmup + times):
        with statement_time() as statements:
            started = time.perf_counter()
            request()
            elapsed = time.perf_counter() - started
        if n >= warmup:
            spent.append(elapsed * 1000)
            in_db.append(sum(statements) * 1000)
    return spent, in_db


def time_pages(client: Any, times: int) -> dict[str, tuple[float, float]]:
    from django.urls import reverse

    result = {}
    for label, url in pages():
        if url is None:
            url = next_page_url(client, reverse("dashboard:runs"))
        response = client.get(url)
        if response.status_code != 200:
            raise SystemExit(f"{label}: {url} answered {response.status_code}")
        result[label] = timed(lambda url=url: client.get(url), times)
        log(f"    {label:<32} {result[label][0]:8.1f} ms ({result[label][1]:.1f} ms in statements)")
    return result


@contextmanager
def statement_time() -> Iterator[list[float]]:
    """Seconds spent in database statements inside the block (appended to the yielded list)."""
    from django.db import connection

    spent: list[float] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            spent.append(time.perf_counter() - started)

    with connection.execute_wrapper(wrapper):
        yield spent


def sampling_ms(times: int) -> tuple[float, float, float, float, float | None]:
    """The poller's sampling pass, each at the next interval (so it writes rows): the median of
    its wall time and of its statements' time, the worst of each, and the median of the CPU
    time its database server process spent on it (None where it cannot be read), in ms. On a
    busy host the wall times include waiting for a core; the server's CPU time does not."""
    from django.utils import timezone

    from durable_flow.engine import get_engine
    from durable_flow.observe.sampling import take_samples

    engine = get_engine()
    start = timezone.now()
    interval = engine.settings.sample_interval_s
    passes = iter(range(1, 10_000))
    server = ServerCpu()
    cpu: list[float] = []

    def one_pass() -> None:
        before = server.ns()
        take_samples(engine, start + timedelta(seconds=interval * next(passes)))
        after = server.ns()
        if before is not None and after is not None:
            cpu.append((after - before) / 1e6)

    spent, in_db = timings(one_pass, times)
    cpu = cpu[-times:]  # the timed passes, not the warm-up
    return (
        statistics.median(spent),
        statistics.median(in_db),
        max(spent),
        max(in_db),
        statistics.median(cpu) if cpu else None,
    )


class ServerCpu:
    """The CPU time the server process behind Django's connection has run, read from Linux's
    `/proc/<pid>/schedstat` (the database is on this host): None where it cannot be read."""

    def __init__(self) -> None:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            self.path = Path(f"/proc/{cursor.fetchone()[0]}/schedstat")

    def ns(self) -> int | None:
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


def tick_db_ms(times: int) -> dict[str, float]:
    """Per tab kind: the median database time of one live tick computed for that tab alone."""
    from durable_flow_dashboard import live

    result = {}
    for topic in ("overview", "queues", "queue:imports", "workers", "flow:imports"):
        if live.parse_topic(topic) is None:
            continue
        spent = []
        for n in range(2 + times):
            with statement_time() as statements:
                live.compute_tick([topic])
            if n >= 2:
                spent.append(sum(statements) * 1000)
        result[topic] = statistics.median(spent)
    return result


def load_average() -> str:
    """The host's 1-minute load average (the bench shares the host: it says how much)."""
    return f"{os.getloadavg()[0]:.1f}"


def figure(ms: float | None, width: int) -> str:
    """`ms` in a column `width` wide, a dash when not measured (a reused history)."""
    return f"{'-':>{width}}" if ms is None else f"{ms:{width}.1f}"


def ratio(loaded: float, empty: float | None) -> str:
    return f"{'-':>5}" if empty is None else f"{loaded / empty:5.2f}"


def table_rows() -> dict[str, int]:
    """The history tables' row counts."""
    from django.db import connection

    with connection.cursor() as cursor:
        rows = {}
        for table in ("workflowrun", "stepcheckpoint", "stepattempt"):
            cursor.execute(f"SELECT count(*) FROM durable_flow_{table}")
            rows[table] = cursor.fetchone()[0]
    return rows


def verdict(empty: float | None, loaded: float) -> str:
    """Against the targets: the ratio's only when the empty tables were timed."""
    allowed = PAGE_MS if empty is None else min(PAGE_MS, max(PAGE_RATIO * empty, 30.0))
    return "ok" if loaded <= allowed else f"SLOW (> {allowed:.0f} ms)"


def main() -> None:
    args = parse_args()
    database = args.database
    reused = setup_django(database, args.reuse)
    if reused is not None and reused != args.scale:
        raise SystemExit(f"{database} holds a history at scale {reused:g}, not {args.scale:g}")
    from django.db import connection
    from django.test import Client

    empty_pages: dict[str, tuple[float, float]] = {}
    empty_sampling: tuple[float, float, float, float, float | None] | None = None
    empty_tick: dict[str, float] = {}
    try:
        load_before = load_average()
        if reused is None:
            register_fixtures()
        client = Client()
        client.force_login(__import__("django.contrib.auth").contrib.auth.get_user_model().objects.get())
        if reused is None:
            # "Empty": no history, but a page's worth of runs of each kind, so each page renders
            # the rows it renders with the history and the ratio is the history's cost alone.
            load_history("a", BASE_FINISHED, BASE_WAITING, BASE_SLEEPING, quiet=True)
            log("empty tables (no history):")
            empty_pages = time_pages(client, args.requests)
            empty_sampling = sampling_ms(args.requests)
            empty_tick = tick_db_ms(args.requests)
            log(f"history at scale {args.scale:g}:")
            started = time.perf_counter()
            rows = load_history(
                "b",
                max(1, round(FINISHED * args.scale)),
                max(1, round(WAITING * args.scale)),
                max(1, round(SLEEPING * args.scale)),
            )
            load_s = time.perf_counter() - started
            if args.reuse:
                with connection.cursor() as cursor:
                    cursor.execute(f"CREATE TABLE {LOADED} (scale float NOT NULL)")
                    cursor.execute(f"INSERT INTO {LOADED} VALUES (%s)", [args.scale])
        else:
            log(f"history at scale {args.scale:g} kept in {database}: the empty tables are not timed")
            rows, load_s = table_rows(), 0.0
        log("with history:")
        loaded_pages = time_pages(client, args.requests)
        loaded_sampling = sampling_ms(args.requests)
        loaded_tick = tick_db_ms(args.requests)
        load_after = load_average()
    finally:
        from django.db import connections

        connections.close_all()
        if not (args.keep or args.reuse):
            pg_admin(f"DROP DATABASE IF EXISTS {database}")

    print(f"operator surfaces with a history (PostgreSQL, scale {args.scale:g}, median of {args.requests} requests)")
    print(
        f"  history: {rows['workflowrun']:,} runs, {rows['stepcheckpoint']:,} checkpoints, "
        f"{rows['stepattempt']:,} attempts (loaded in {load_s:.0f} s); load average {load_before} / {load_after}"
    )
    print()
    print(f"| {'page or endpoint':<32} | empty ms | history ms | ratio | DB ms empty / history | verdict |")
    print(f"|{'-' * 34}|---------:|-----------:|------:|----------------------:|---------|")
    for label, (loaded, in_db) in loaded_pages.items():
        empty, empty_db = empty_pages.get(label, (None, None))
        print(
            f"| {label:<32} | {figure(empty, 8)} | {loaded:10.1f} | {ratio(loaded, empty)} | "
            f"{figure(empty_db, 9)} / {in_db:9.1f} | {verdict(empty, loaded)} |"
        )
    (empty_s, empty_s_db, *_), (loaded_s, sampling_db, worst_s, worst_s_db, server_cpu) = (
        empty_sampling or (None, None),
        loaded_sampling,
    )
    print(
        f"| {'poller sampling pass':<32} | {figure(empty_s, 8)} | {loaded_s:10.1f} | {ratio(loaded_s, empty_s)} | "
        f"{figure(empty_s_db, 9)} / {sampling_db:9.1f} | "
        f"{'ok' if loaded_s <= SAMPLING_MS else f'SLOW (> {SAMPLING_MS:.0f} ms)'} |"
    )
    for topic, loaded in loaded_tick.items():
        empty = empty_tick.get(topic)
        label = f"live tick DB, tab {topic}"
        print(
            f"| {label:<32} | {figure(empty, 8)} | {loaded:10.1f} | {ratio(loaded, empty)} | "
            f"{figure(empty, 9)} / {loaded:9.1f} | {'ok' if loaded <= TICK_MS else f'SLOW (> {TICK_MS:.0f} ms)'} |"
        )
    slowest = max(loaded for loaded, _ in loaded_pages.values())
    lines = []
    if empty_pages:
        worst = max(loaded_pages[label][0] / empty_pages[label][0] for label in empty_pages)
        lines.append(f"worst page ratio history / empty: {worst:.2f} (target <= {PAGE_RATIO:g})")
    lines += [
        f"slowest page with history: {slowest:.1f} ms (target <= {PAGE_MS:g} ms)",
        f"sampling pass with history: {loaded_s:.1f} ms, {sampling_db:.1f} ms in statements "
        f"(worst {worst_s:.1f} ms, {worst_s_db:.1f} ms in statements; target <= {SAMPLING_MS:g} ms)",
    ]
    if server_cpu is not None:
        lines.append(
            f"sampling pass's database server CPU time: {server_cpu:.1f} ms (median; waits for a core not counted)"
        )
    lines.append(f"worst live tick DB time per tab: {max(loaded_tick.values()):.1f} ms (target <= {TICK_MS:g} ms)")
    print()
    print("\n".join(f"  {line}" for line in lines))
    empty_ms = {label: figures[0] for label, figures in empty_pages.items()}
    slow_pages = [label for label, (loaded, _) in loaded_pages.items() if verdict(empty_ms.get(label), loaded) != "ok"]
    reporting.write_json(
        "surfaces",
        {
            "scale": args.scale,
            "requests": args.requests,
            "reused": reused is not None,
            "rows": rows,
            "load_s": load_s,
            "load_average": [load_before, load_after],
            "pages": {
                label: {
                    "empty_ms": empty_pages.get(label, (None, None))[0],
                    "empty_db_ms": empty_pages.get(label, (None, None))[1],
                    "history_ms": loaded,
                    "history_db_ms": in_db,
                    "ratio": loaded / empty_pages[label][0] if label in empty_pages else None,
                    "verdict": verdict(empty_ms.get(label), loaded),
                }
                for label, (loaded, in_db) in loaded_pages.items()
            },
            "sampling": {
                "empty_ms": empty_s,
                "empty_db_ms": empty_s_db,
                "history_ms": loaded_s,
                "history_db_ms": sampling_db,
                "history_worst_ms": worst_s,
                "history_worst_db_ms": worst_s_db,
                "server_cpu_ms": server_cpu,
            },
            "live_tick_db_ms": {
                topic: {"empty": empty_tick.get(topic), "history": loaded} for topic, loaded in loaded_tick.items()
            },
        },
        path=args.json,
        summary=lines + [f"SLOW: {label}" for label in slow_pages],
        targets=[
            reporting.target(
                f"pages over {PAGE_MS:g} ms, or {PAGE_RATIO:g}x empty (30 ms at least)", len(slow_pages), "==", 0
            ),
            reporting.target("slowest page with history, ms", slowest, "<=", PAGE_MS),
            reporting.target("sampling pass with history, ms", loaded_s, "<=", SAMPLING_MS),
            reporting.target("worst live tick DB time per tab, ms", max(loaded_tick.values()), "<=", TICK_MS),
        ],
    )


if __name__ == "__main__":
    main()
