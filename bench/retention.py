#!/usr/bin/env python
"""Does the poller's purge of finished runs slow the workload running beside it?

    .venv/bin/python bench/retention.py --postgres --history 1000000   # the figure (about an hour)
    .venv/bin/python bench/retention.py --postgres --history 1000000 --keep    # ... and keep the loaded history
    .venv/bin/python bench/retention.py --postgres --history 1000000 --reuse   # time a kept one again
    .venv/bin/python bench/retention.py --history 20000 --max-pairs 2          # SQLite, a quick look

`--history` finished runs, finished a day ago and more, are loaded with bulk SQL on PostgreSQL
(bench/surfaces.py's history: two steps a run, an attempt a step and a retried one in twenty,
inputs, outputs and tags; then VACUUM ANALYZE) or `bulk_create` on SQLite (bench/history.py's:
one step, one attempt). Then the bench times a queued workload in windows, two kinds
alternating until the poller has purged the whole history:

- *beside*: a `durable_poller` with `POLLER["RUN_RETENTION_S"]` set deletes the history at its
  own pace (each `MAINTENANCE_S`, at most `PURGE_BATCHES` batches of `PURGE_BATCH_SIZE` runs
  and no new batch past `PURGE_PASS_S`; and its vacuum of the tables the purge leaves dead rows
  in, as deployed), started before the window's runs are queued and given until its first purge;
- *alone*: the same poller with no retention.

A window is `--runs` one-step no-op workflows queued up front, run by one fresh
`durable_worker --concurrency 8` (the `db` transport and admission) and timed between the 10 %
and 90 % completion marks (bench/transport.py's `steady_rate`). A pair is one window of each,
their order alternating from pair to pair, so a host whose speed moves over the hour weighs on
both; a purge stopped with its window resumes with the next beside window (each batch commits
whole). Between windows the bench waits for any VACUUM still running in the database, so one
window's vacuum is not timed in the next.

Printed: the workload's rate beside the purge over its rate alone, the median of the pairs
(target >= 0.9: a tenth slower at most) and the worst pair; the purge's throughput (runs deleted
per second of beside windows: the poller's pace, not the database's limit); its longest
transaction (the poller logs each pass's); the poller's vacuums; the host's load average at each
window, and each pair's figures as it ends. A last beside window in which the history ran out
is timed partly without a purge: it is shown, and left out of the median. A TERM stops the
bench and reports the pairs done.

On PostgreSQL the databases are this bench's own (`bench_retention_*`), dropped after unless
`--keep` or `--reuse` keeps the loaded history as a template database (about 1.5 GB at 1,000,000
runs), which the next `--reuse` run copies (`CREATE DATABASE ... TEMPLATE`) instead of loading.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import fleet
import history
import reporting
import services
import surfaces

#: RUN_RETENTION_S of the beside windows' poller: the history (a day old and more) goes, the
#: workload's runs (minutes old at most) stay.
RETENTION_S = 6 * 3600
#: The history's runs are loaded finished this long ago and more.
AGED_S = 86_400
#: The work database, and the template a kept history lives in.
WORK_DB, TEMPLATE_DB = "bench_retention_work", "bench_retention_template"
#: A table in the template holding how many runs of history it was loaded with.
LOADED = "bench_retention_loaded"

DELETED = re.compile(
    r"retention deleted (\d+) finished run\(s\) \((\d+) row\(s\)\) in (\d+) batch\(es\), longest transaction (\d+) ms"
)
VACUUMED = re.compile(r"vacuumed (\w+): .* in ([\d.]+) s")


@dataclass
class Window:
    """One timed window: its kind, the workload's rate, what the poller did meanwhile."""

    kind: str
    rate: float
    seconds: float
    load: float
    purged: int = 0
    rows: int = 0
    batches: int = 0
    longest_ms: int = 0
    vacuums: list[tuple[str, float]] = field(default_factory=list)
    vacuum_wait_s: float = 0.0
    #: Runs of history left at its end (a beside window that ended at 0 ran out of history).
    left: int = 0


# -- the databases --------------------------------------------------------------------------------
def django_env(database: str | None) -> None:
    """This process's and its children's settings: `settings.test`, DEBUG off, the embedded
    default (`db` transport and admission), on PostgreSQL's `database` or a SQLite file."""
    os.environ.update(
        {
            "DURABLE_FLOW_TEST_ID": f"bench-retention-{os.getpid()}",
            "DJANGO_SETTINGS_MODULE": "settings.test",
            "DURABLE_FLOW_TRANSPORT": "db",
            "DURABLE_FLOW_ADMISSION": "db",
            "DURABLE_FLOW_LOG": "WARNING",
            "DJANGO_DEBUG": "0",
        }
    )
    for variable in ("DURABLE_FLOW_SUBPROCESS", "DURABLE_FLOW_TEST_MARKER", "DURABLE_FLOW_RUN_RETENTION_S"):
        os.environ.pop(variable, None)
    if database is None:
        os.environ.pop("DATABASE_URL", None)
    else:
        os.environ["DATABASE_URL"] = f"{services.PG_SERVER}/{database}"


def pg_exists(database: str) -> bool:
    return bool(services.pg_admin(f"SELECT 1 FROM pg_database WHERE datname = '{database}'"))


def kept_history() -> int | None:
    """How many runs of history the template database was loaded with (None: no complete load)."""
    import psycopg

    if not pg_exists(TEMPLATE_DB):
        return None
    with psycopg.connect(f"{services.PG_SERVER}/{TEMPLATE_DB}") as conn:
        found = conn.execute("SELECT to_regclass(%s)", [LOADED]).fetchone()
        if found is None or found[0] is None:
            return None
        row = conn.execute(f"SELECT runs FROM {LOADED}").fetchone()
    return None if row is None else int(row[0])


@contextmanager
def pg_stack(count: int, keep: bool, reuse: bool) -> Iterator[float | None]:
    """The work database holding `count` runs of history, migrated; yields the seconds its
    loading took (None: copied from the kept template). Dropped after, and the template too
    unless `keep` or `reuse`."""
    services.pg_admin(f"DROP DATABASE IF EXISTS {WORK_DB} WITH (FORCE)")
    kept = kept_history() if reuse else None
    if reuse and kept is not None and kept != count:
        raise SystemExit(f"{TEMPLATE_DB} holds {kept:,} runs of history, not {count:,}: pass --history {kept}")
    loaded_s: float | None = None
    if kept is not None:
        with reporting.progress(f"copying the kept history ({TEMPLATE_DB})"):
            services.pg_admin(f"CREATE DATABASE {WORK_DB} TEMPLATE {TEMPLATE_DB} STRATEGY FILE_COPY")
    else:
        services.pg_admin(f"CREATE DATABASE {WORK_DB}")
    django_env(WORK_DB)
    import django
    from django.core.management import call_command
    from django.db import connection, connections

    django.setup()
    call_command("migrate", verbosity=0)
    try:
        if kept is not None:
            # A copied database starts with no statistics: without these row counts the poller
            # would take each history table for empty and vacuum it at its first 2,000 dead rows.
            with reporting.progress("ANALYZE of the copied history"), connection.cursor() as cursor:
                tables = ("workflowrun", "stepcheckpoint", "stepattempt")
                cursor.execute("ANALYZE " + ", ".join(f"durable_flow_{table}" for table in tables))
        if kept is None:
            started = time.perf_counter()
            reporting.log(f"loading {count:,} finished runs of history (bulk SQL, then VACUUM ANALYZE)")
            rows = surfaces.load_history("h", count, 0, 0, aged_s=AGED_S)
            loaded_s = time.perf_counter() - started
            reporting.log(f"loaded in {loaded_s:.0f} s: {rows}")
            if keep or reuse:
                with connection.cursor() as cursor:
                    cursor.execute(f"CREATE TABLE {LOADED} (runs bigint NOT NULL)")
                    cursor.execute(f"INSERT INTO {LOADED} VALUES (%s)", [count])
                connections.close_all()
                with reporting.progress(f"keeping the history as {TEMPLATE_DB}"):
                    services.pg_admin(f"DROP DATABASE IF EXISTS {TEMPLATE_DB} WITH (FORCE)")
                    services.pg_admin(f"CREATE DATABASE {TEMPLATE_DB} TEMPLATE {WORK_DB} STRATEGY FILE_COPY")
        yield loaded_s
    finally:
        connections.close_all()
        services.pg_admin(f"DROP DATABASE IF EXISTS {WORK_DB} WITH (FORCE)")
        if not (keep or reuse):
            services.pg_admin(f"DROP DATABASE IF EXISTS {TEMPLATE_DB} WITH (FORCE)")


@contextmanager
def sqlite_stack(count: int) -> Iterator[float]:
    """A SQLite file of its own holding `count` runs of history (`bulk_create`, then aged)."""
    with fleet.sqlite_stack("retention"):
        started = time.perf_counter()
        history.add_history(count)
        age_history(count)
        yield time.perf_counter() - started


def age_history(count: int) -> None:
    """Created a minute before they finished, as the engine leaves them (`bulk_create` stamps
    `created_at` now), in transactions of `history.BATCH` runs."""
    from datetime import timedelta

    from django.db import transaction
    from django.utils import timezone

    from durable_flow.models import WorkflowRun

    created = timezone.now() - timedelta(seconds=AGED_S, minutes=1)
    with reporting.progress("ageing the history", total=count, unit="runs") as shown:
        for offset in range(0, count, history.BATCH):
            ids = [f"history-{i:07d}" for i in range(offset, min(count, offset + history.BATCH))]
            with transaction.atomic():
                WorkflowRun.objects.filter(id__in=ids).update(created_at=created)
            shown.advance(len(ids))


def history_left() -> int:
    """Runs of history not purged yet (their ids, and only theirs, start with `h`)."""
    from durable_flow.models import WorkflowRun

    return WorkflowRun.objects.filter(id__gte="h", id__lt="i").count()


def vacuums_running() -> int:
    """VACUUMs under way in this database (the poller's, which outlive it: the server does not
    notice a client gone mid-statement). None on SQLite."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return 0
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_progress_vacuum WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def settle_vacuums(timeout_s: float = 600) -> float:
    """Wait for the VACUUMs under way to end; the seconds waited."""
    started = time.monotonic()
    while vacuums_running() and time.monotonic() - started < timeout_s:
        time.sleep(0.2)
    return time.monotonic() - started


# -- a window -------------------------------------------------------------------------------------
def start_poller(purging: bool, log: Path) -> subprocess.Popen[bytes]:
    """A `durable_poller` logging at INFO to `log`, with retention (`RETENTION_S`) or without;
    returned once it runs, and with retention once it purged its first batches."""
    env = {**os.environ, "DURABLE_FLOW_LOG": "INFO", "PYTHONUNBUFFERED": "1"}
    if purging:
        env["DURABLE_FLOW_RUN_RETENTION_S"] = str(RETENTION_S)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(fleet.ROOT / "manage.py"), "durable_poller"],
            cwd=fleet.ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    ready = "retention deleted" if purging else "durable_poller: every"
    deadline = time.monotonic() + 300
    while ready not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if ready not in log.read_text():
        services.stop([proc])
        raise SystemExit(f"the poller did not start (waited for {ready!r}): {log.read_text()[-2000:]}")
    return proc


def timed_window(kind: str, index: int, runs: int) -> Window:
    """One window of `kind` (beside or alone) over `runs` fresh workflows."""
    prefix = f"{kind}{index}"
    log = fleet.ROOT / "var" / f"bench-retention-{os.getpid()}-{prefix}.log"
    load = os.getloadavg()[0]
    started = time.monotonic()
    # Before the runs are queued, so a beside window purges while they are too (untimed).
    poller = start_poller(kind == "beside", log)
    try:
        fleet.start_runs(prefix, runs)
        procs = fleet.workers(1, concurrency=8)
        try:
            rate = fleet.steady_rate(lambda: fleet.completed(prefix), runs, procs, timeout=900)
        finally:
            fleet.stop(procs)
    finally:
        services.stop([poller], timeout_s=60)  # a purge between or inside a batch: no orphan row
    window = Window(kind, rate, time.monotonic() - started, load)
    text = log.read_text()
    log.unlink()
    for match in DELETED.finditer(text):
        window.purged += int(match.group(1))
        window.rows += int(match.group(2))
        window.batches += int(match.group(3))
        window.longest_ms = max(window.longest_ms, int(match.group(4)))
    window.vacuums = [(table, float(seconds)) for table, seconds in VACUUMED.findall(text)]
    if "Traceback" in text:
        raise SystemExit(f"the poller failed: {text[-3000:]}")
    window.vacuum_wait_s = settle_vacuums()
    window.left = history_left()
    return window


def main() -> None:
    # A TERM ends the bench through its cleanup (the poller and workers stopped, its databases
    # dropped), as Ctrl-C does; a shell's background job ignores INT.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=100_000, help="finished runs to purge (default 100,000)")
    parser.add_argument("--runs", type=int, default=3000, help="workflows timed per window (default 3,000)")
    parser.add_argument("--max-pairs", type=int, default=None, help="stop after this many pairs (default: none)")
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL instead of SQLite")
    parser.add_argument("--keep", action="store_true", help=f"PostgreSQL: keep the loaded history ({TEMPLATE_DB})")
    parser.add_argument("--reuse", action="store_true", help="PostgreSQL: copy the history --keep kept, and keep it")
    reporting.add_json_option(parser, "retention")
    args = parser.parse_args()
    if min(args.runs, args.history, args.max_pairs or 1) < 1:
        raise SystemExit("--runs, --history, --max-pairs: at least 1")
    if (args.keep or args.reuse) and not args.postgres:
        raise SystemExit("--keep and --reuse keep a PostgreSQL template database: pass --postgres")
    if not args.postgres:
        django_env(None)
    windows: list[Window] = []
    began = time.monotonic()
    stack = pg_stack(args.history, args.keep, args.reuse) if args.postgres else sqlite_stack(args.history)
    with stack as loaded_s:
        left = history_left()
        pair = 0
        try:
            while left and (args.max_pairs is None or pair < args.max_pairs):
                order = ("beside", "alone") if pair % 2 == 0 else ("alone", "beside")
                reporting.log(
                    f"pair {pair + 1}: {args.runs} runs {order[0]}, then {order[1]}; {left:,} runs of history "
                    f"left ({(args.history - left) / args.history:.0%} purged, {time.monotonic() - began:.0f} s in)"
                )
                done = {kind: timed_window(kind, pair, args.runs) for kind in order}
                windows.extend(done.values())
                pair += 1
                left = windows[-1].left
                with_purge, without = done["beside"], done["alone"]
                reporting.log(
                    f"pair {pair}: alone {without.rate:.0f} wf/s, beside {with_purge.rate:.0f} wf/s: "
                    f"{with_purge.rate / without.rate:.2f}; {with_purge.purged:,} runs purged, "
                    f"{with_purge.purged / with_purge.seconds:.0f}/s"
                )
        except SystemExit as stopped:  # a TERM: the pairs done so far are reported
            reporting.log(f"stopped ({stopped}) after {pair} pair(s)")
            left = history_left()
        database = "PostgreSQL" if args.postgres else "SQLite"
    report(args, windows, left, loaded_s, database)


def report(args: argparse.Namespace, windows: list[Window], left: int, loaded_s: float | None, database: str) -> None:
    beside = [w for w in windows if w.kind == "beside"]
    alone = [w for w in windows if w.kind == "alone"]
    pairs = list(zip(beside, alone, strict=True))
    if not pairs:
        raise SystemExit("no pair of windows was timed")
    # A beside window whose purge ran out of history was partly timed without one.
    full = [(b, a) for b, a in pairs if b.left]
    ratios = [b.rate / a.rate for b, a in full] or [float("nan")]
    ratio, worst = median(ratios), min(ratios)
    purged = sum(w.purged for w in beside)
    beside_s = sum(w.seconds for w in beside)
    longest = max((w.longest_ms for w in beside), default=0)
    vacuums = [v for w in windows for v in w.vacuums]
    loads = [w.load for w in windows]
    if not full:
        verdict = "not measured: every beside window ran out of history; give --history more runs"
    else:
        verdict = "within" if ratio >= 0.9 else "SLOWER"
    left_out = f"; {len(pairs) - len(full)} pair(s) left out: the history ran out" if len(full) < len(pairs) else ""
    from durable_flow.config.settings import get_settings

    pace = get_settings()
    print(
        f"a workload beside the poller's purge of {args.history:,} finished runs ({database}, db transport, "
        f"1 worker x 8 threads, {args.runs} runs a window; the poller's pace: batches of {pace.purge_batch_size}, "
        f"at most {pace.purge_batches} and {pace.purge_pass_s:g} s a pass, a pass each {pace.poller_maintenance_s:g} s)"
    )
    lines = [
        f"alone:        {median(w.rate for w in alone):7.1f} wf/s   (median of {len(alone)} windows)",
        f"beside purge: {median(w.rate for w in beside):7.1f} wf/s   "
        + (f"(history loaded in {loaded_s:.0f} s)" if loaded_s is not None else "(history copied from the kept one)"),
        "pairs, alone:beside wf/s " + " / ".join(f"{a.rate:.0f}:{b.rate:.0f}" for b, a in pairs),
        f"runs purged: {purged:,} of {args.history:,} ({left:,} left) in {len(beside)} beside windows, "
        f"{purged / beside_s:.0f} runs/s over their {beside_s:.0f} s",
        f"the purge's longest transaction: {longest} ms; "
        f"{sum(w.batches for w in beside):,} batches, {sum(w.rows for w in beside):,} rows",
        f"the poller's vacuums: {len(vacuums)} ({sum(s for _, s in vacuums):.0f} s in all, longest "
        f"{max((s for _, s in vacuums), default=0):.1f} s); waited {sum(w.vacuum_wait_s for w in windows):.0f} s "
        "for vacuums outliving their window",
        f"load average (1 min) at the windows' start: min {min(loads):.1f}, median {median(loads):.1f}, "
        f"max {max(loads):.1f}",
        f"beside / alone, median of {len(full)} pairs: {ratio:.2f} (target >= 0.9, a slow-down of at most 10 %: "
        f"{verdict}){left_out}",
        f"worst pair: {worst:.2f}",
    ]
    print("\n".join(f"  {line}" for line in lines))
    reporting.write_json(
        "retention",
        {
            "database": database.lower(),
            "history_runs": args.history,
            "history_left": left,
            "runs_per_window": args.runs,
            "loaded_s": loaded_s,
            "windows": [w.__dict__ for w in windows],
            "ratios": ratios,
            "ratio": ratio,
            "worst": worst,
            "purged_runs_per_s": purged / beside_s if beside_s else None,
            "longest_transaction_ms": longest,
        },
        path=args.json,
        summary=lines,
        targets=[reporting.target("beside the purge / alone, median of the pairs", ratio, ">=", 0.9)],
    )


if __name__ == "__main__":
    main()
