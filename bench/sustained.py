#!/usr/bin/env python
"""Sustained load on PostgreSQL: does throughput hold while the hot tables gather dead rows?

    .venv/bin/python bench/sustained.py                          # 30 minutes, arm "tuned"
    .venv/bin/python bench/sustained.py --minutes 6 --arm baseline,tuned --json var/sustained.json
    .venv/bin/python bench/sustained.py --server postgres://postgres@127.0.0.1:5442 ...  # another server

A steady queued workload: one `durable_worker` process (`--concurrency` threads, 10) and one
`durable_poller` run one-step no-op workflows (`tests.queued`) through one queue of
concurrency 10, on the embedded default's backends (`db` transport, `db` admission) and a
PostgreSQL database of this bench's own (created, then dropped). A feeder in this process
keeps `--backlog` (2,000) runs queued, topping the backlog up every half second, so the
worker never runs dry and never faces an ever-growing queue. Finished runs stay: their history
grows as it would in production.

Every minute it prints the workflows completed per second in that minute, and for each hot table
its dead and live rows (`pg_stat_user_tables`' `n_dead_tup` / `n_live_tup`), how many times it
was vacuumed (by hand or by the poller, `vacuum_count`) and autovacuumed (`autovacuum_count`);
between minutes, a progress line every `--progress-s` (10) seconds. At the end, per workflow,
the rows each hot table took (inserted, updated, of which HOT, deleted): what each workflow
leaves for a vacuum to clean.

Arms (`--arm`, comma-separated), each in a child process of its own on a fresh database of its
own, all side by side (`--sequential`: one after the other), so that on a shared host whose speed
moves within minutes every arm sees the same host minute by minute; compare each with its own
first minute, and the arms with each other, minute by minute:

* `baseline`: the hot tables' storage parameters reset to PostgreSQL's defaults (as before the
  migration that sets them) and the poller's vacuum off (`POLLER["VACUUM_DEAD_ROWS"]: None`).
* `tuned`: the project's defaults (the migration's storage parameters, the poller's vacuum).
* `novacuum`: the migration's storage parameters, the poller's vacuum off (what the storage
  parameters alone do, e.g. under PostgreSQL's own autovacuum).

The figures, per arm and minute, go to `--json PATH` as well (one `json.dump` of a dict). The
target is the `tuned` arm's (the project's defaults): `GOAL_MINUTES` (30) minutes of load, its
worst minute at least 0.9 of its first; a shorter run records the minutes it ran against the 30
(not met), the other arms are printed for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it
import services  # noqa: E402 - bench/ is on the path of a script run from it
from services import stop  # noqa: E402 - bench/ is on the path of a script run from it

PG_SERVER = "postgres://postgres@127.0.0.1:5432"
PG_DATABASE = f"durable_flow_bench_sustained_{os.getpid()}"  # its own: other sessions may run benches too
QUEUE = "bench-sustained"
PYTHON = str(ROOT / ".venv" / "bin" / "python")
#: The tables a queued one-step workflow writes (`app_label` prefix added below).
HOT = ("task", "workflowrun", "stepcheckpoint", "stepattempt", "admissionslot", "flowqueue", "queuecounter")
TABLES = tuple(f"durable_flow_{name}" for name in HOT)
ARMS = ("baseline", "tuned", "novacuum")
#: The goal, on the project's defaults (the `tuned` arm): GOAL_MINUTES of load, every minute at
#: least GOAL_WORST_OF_FIRST of the first minute's rate (within 10 % of it).
GOAL_MINUTES, GOAL_WORST_OF_FIRST = 30, 0.9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30, help="minutes of load per arm")
    parser.add_argument("--arm", default="tuned", help=f"comma-separated arms, run in order: {', '.join(ARMS)}")
    parser.add_argument("--concurrency", type=int, default=10, help="worker threads and the queue's concurrency")
    parser.add_argument("--backlog", type=int, default=2000, help="runs the feeder keeps queued")
    parser.add_argument("--progress-s", type=float, default=10, help="seconds between progress lines")
    reporting.add_json_option(parser, "sustained")
    parser.add_argument("--sequential", action="store_true", help="run the arms one after the other")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child process
    parser.add_argument(
        "--server",
        default=PG_SERVER,
        help="the PostgreSQL server (e.g. one of your own with autovacuum on, as production runs)",
    )
    args = parser.parse_args()
    arms = args.arm.split(",")
    if unknown := set(arms) - set(ARMS):
        parser.error(f"--arm: unknown {', '.join(sorted(unknown))} (known: {', '.join(ARMS)})")
    if not 0 < args.minutes <= 24 * 60 or args.concurrency < 1 or args.backlog < 1 or args.progress_s <= 0:
        parser.error("--minutes, --concurrency, --backlog and --progress-s must be positive")
    args.arms = arms
    return args


def say(line: str, end: str = "\n") -> None:
    print(line, end=end, flush=True)


def pg_admin(sql: str) -> Any:
    return services.pg_admin(sql, PG_SERVER)  # the server --server names


def setup_django() -> None:
    os.environ.update(
        {
            "DURABLE_FLOW_TEST_ID": "bench-sustained",
            "DJANGO_SETTINGS_MODULE": "settings.test",
            "DATABASE_URL": f"{PG_SERVER}/{PG_DATABASE}",
            "DURABLE_FLOW_TRANSPORT": "db",
            "DURABLE_FLOW_ADMISSION": "db",
            "DURABLE_FLOW_LOG": "WARNING",
            "DJANGO_DEBUG": "0",  # as deployed: DEBUG keeps every query's SQL in memory
        }
    )
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    import django

    django.setup()


def fresh_database(arm: str) -> None:
    """Drop and re-create the bench's database, migrate it, and set the arm's storage parameters."""
    from django.core.management import call_command
    from django.db import connection, connections

    connections.close_all()
    pg_admin(f"DROP DATABASE IF EXISTS {PG_DATABASE} WITH (FORCE)")
    pg_admin(f"CREATE DATABASE {PG_DATABASE}")
    say(f"[{arm}] migrating a fresh database {PG_DATABASE}")
    call_command("migrate", verbosity=0)
    if arm == "baseline":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT relname, reloptions FROM pg_class WHERE relname = ANY(%s) AND reloptions IS NOT NULL",
                [list(TABLES)],
            )
            for table, options in cursor.fetchall():
                names = ", ".join(option.partition("=")[0] for option in options)
                cursor.execute(f"ALTER TABLE {table} RESET ({names})")


def table_stats() -> dict[str, dict[str, int]]:
    """`pg_stat_user_tables`' figures of the hot tables (the statistics this session sees now)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT relname, n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,"
            " vacuum_count, autovacuum_count, pg_total_relation_size(relid)"
            " FROM pg_stat_user_tables WHERE relname = ANY(%s)",
            [list(TABLES)],
        )
        keys = ("live", "dead", "ins", "upd", "hot_upd", "del", "vacuums", "autovacuums", "bytes")
        return {row[0]: dict(zip(keys, row[1:], strict=True)) for row in cursor.fetchall()}


def claim_pages() -> tuple[int, str]:
    """The pages (buffers) the `db` transport's claim reads to find the next task now: a figure
    the host's load does not move, that grows as dead index entries pile up before the live
    rows (the claim's pick, as `store/tasks.py` sends it, without the lock), and how the planner
    reads the table (an index scan, or the whole table when it has no statistics)."""
    from django.db import connection

    from durable_flow.models import Task

    table = connection.ops.quote_name(Task._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT id FROM {table} WHERE claimed_by IS NULL"
            " AND available_at <= now() ORDER BY kind, priority DESC, id LIMIT 1"
        )
        plan = cursor.fetchone()[0]
    top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    scans = []
    nodes = [top]
    while nodes:
        node = nodes.pop()
        scans += [node["Node Type"]] if node["Node Type"].endswith("Scan") else []
        nodes += node.get("Plans", [])
    return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"]), "+".join(scans)


class Feeder(threading.Thread):
    """Keeps `backlog` runs queued: every half second, starts what is missing in one transaction."""

    def __init__(self, backlog: int) -> None:
        super().__init__(daemon=True)
        self.backlog = backlog
        self.started = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def open_runs(self) -> int:
        from durable_flow.models import RunStatus, WorkflowRun

        live = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED)
        return WorkflowRun.objects.filter(workflow="tests.queued", status__in=live).count()

    def run(self) -> None:
        from django.db import connections, transaction

        from durable_flow.engine import get_engine

        engine = get_engine()
        try:
            while not self.stop.is_set():
                missing = self.backlog - self.open_runs()
                with transaction.atomic():
                    for _ in range(max(0, min(missing, 1000))):
                        engine.start("tests.queued", {"queue": QUEUE, "value": self.started})
                        self.started += 1
                self.stop.wait(0.5)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
        finally:
            connections.close_all()


def completed() -> int:
    from durable_flow.models import RunStatus, WorkflowRun

    return WorkflowRun.objects.filter(workflow="tests.queued", status=RunStatus.COMPLETED).count()


def start_processes(arm: str, concurrency: int) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if arm in ("baseline", "novacuum"):
        env["DURABLE_FLOW_VACUUM_DEAD_ROWS"] = "off"  # settings/test.py: POLLER["VACUUM_DEAD_ROWS"] None
    else:
        env.pop("DURABLE_FLOW_VACUUM_DEAD_ROWS", None)  # the project's default
    manage = [PYTHON, str(ROOT / "manage.py")]
    log = open(ROOT / "var" / f"bench-sustained-{arm}-poller.log", "w")  # the poller's log
    return [
        subprocess.Popen(
            [*manage, "durable_worker", "--concurrency", str(concurrency)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [*manage, "durable_poller"], cwd=ROOT, env={**env, "DURABLE_FLOW_LOG": "INFO"}, stdout=log, stderr=log
        ),
    ]


def still_waiting(arm: str, what: str, since: float, every: float) -> float:
    """A progress line once `every` seconds have passed since `since`; the new `since`."""
    if time.monotonic() < since + every:
        return since
    say(f"    [{arm}] still waiting {what}")
    return time.monotonic()


def short(table: str) -> str:
    return table.removeprefix("durable_flow_")


def minute_line(arm: str, minute: int, rate: float, first: float, stats: dict[str, dict[str, int]]) -> str:
    tables = "; ".join(
        f"{short(t)} {s['dead']}/{s['live']} v{s['vacuums']} av{s['autovacuums']}"
        for t, s in sorted(stats.items())
        if t
        in (
            "durable_flow_task",
            "durable_flow_workflowrun",
            "durable_flow_stepcheckpoint",
            "durable_flow_stepattempt",
            "durable_flow_admissionslot",
        )
    )
    return f"  [{arm}] minute {minute:>3}: {rate:6.1f} wf/s ({rate / first:4.2f} of minute 1); dead/live {tables}"


def per_workflow(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], runs: int
) -> dict[str, dict[str, float]]:
    """Rows each table took per workflow between two snapshots."""
    return {
        table: {
            key: (after[table][key] - before.get(table, {}).get(key, 0)) / max(1, runs)
            for key in ("ins", "upd", "hot_upd", "del")
        }
        for table in sorted(after)
    }


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    from durable_flow.config.queues import QueueConfig
    from durable_flow.engine import get_engine
    from durable_flow.models import WorkerHeartbeat

    fresh_database(arm)
    get_engine().register_queue(QueueConfig.from_mapping({"name": QUEUE, "concurrency": args.concurrency}))
    procs = start_processes(arm, args.concurrency)
    feeder = Feeder(args.backlog)
    minutes: list[dict[str, Any]] = []
    try:
        say(f"[{arm}] starting the worker and the poller")
        waited = started = time.monotonic()
        while not WorkerHeartbeat.objects.filter(stopped_at__isnull=True).exists():
            if any(proc.poll() is not None for proc in procs) or time.monotonic() > started + 120:
                raise SystemExit(f"[{arm}] the durable_worker did not start")
            time.sleep(0.1)
            waited = still_waiting(arm, "for the worker's first heartbeat", waited, args.progress_s)
        feeder.start()
        waited = time.monotonic()
        while completed() == 0:  # the clock starts at the first finished workflow
            if feeder.error or any(proc.poll() is not None for proc in procs):
                raise SystemExit(f"[{arm}] a process died before the first workflow finished")
            time.sleep(0.05)
            waited = still_waiting(arm, "for the first finished workflow", waited, args.progress_s)
        say(f"[{arm}] load on: {args.backlog} runs kept queued, {args.minutes:g} minute(s)")
        begin = time.monotonic()
        stats_begin = table_stats()
        done_begin = completed()
        minute_start, done_at_minute = begin, done_begin
        next_progress = begin + args.progress_s
        total_minutes = int(args.minutes * 60 // 60) or 1
        span = min(60.0, args.minutes * 60)
        while len(minutes) < total_minutes:
            time.sleep(0.25)
            now = time.monotonic()
            if feeder.error:
                raise RuntimeError(f"[{arm}] the feeder failed") from feeder.error
            if any(proc.poll() is not None for proc in procs):
                raise SystemExit(f"[{arm}] a worker or the poller exited")
            if now >= minute_start + span:
                done = completed()
                stats = table_stats()
                rate = (done - done_at_minute) / (now - minute_start)
                first = minutes[0]["rate"] if minutes else rate
                pages, scan = claim_pages()
                minutes.append(
                    {
                        "minute": len(minutes) + 1,
                        "rate": rate,
                        "completed": done - done_begin,
                        "claim_pages": pages,
                        "claim_scan": scan,
                        "tables": stats,
                    }
                )
                say(minute_line(arm, len(minutes), rate, first, stats) + f"; a claim reads {pages} pages ({scan})")
                minute_start, done_at_minute = now, done
                next_progress = now + args.progress_s
            elif now >= next_progress:
                done = completed()
                so_far = (done - done_at_minute) / max(1e-6, now - minute_start)
                say(f"    [{arm}] {now - begin:5.0f} s: {done - done_begin} done, {so_far:.1f} wf/s this minute so far")
                next_progress = now + args.progress_s
        runs = completed() - done_begin
        rows = per_workflow(stats_begin, table_stats(), runs)
    finally:
        feeder.stop.set()
        stop(procs)
        if feeder.is_alive():
            feeder.join(30)
    first, last = minutes[0]["rate"], minutes[-1]["rate"]
    worst = min(m["rate"] for m in minutes)
    say(f"[{arm}] first minute {first:.1f} wf/s, last {last:.1f} ({last / first:.2f}), ", end="")
    say(f"worst {worst:.1f} ({worst / first:.2f})")
    say(f"[{arm}] rows per workflow (inserted / updated (HOT) / deleted):")
    for table, row in rows.items():
        say(f"    {short(table):<16} {row['ins']:5.2f} / {row['upd']:5.2f} ({row['hot_upd']:5.2f}) / {row['del']:5.2f}")
    return {"arm": arm, "minutes": minutes, "first": first, "last": last, "worst": worst, "per_workflow": rows}


def run_child(arm: str, args: argparse.Namespace) -> None:
    """One arm in this process, on a database of its own; its figures to `--json`."""
    global PG_DATABASE
    PG_DATABASE = f"{PG_DATABASE}_{arm}"
    setup_django()
    from django.db import connections

    try:
        result = run_arm(arm, args)
    finally:
        connections.close_all()
        pg_admin(f"DROP DATABASE IF EXISTS {PG_DATABASE} WITH (FORCE)")
    Path(args.json).write_text(json.dumps(result))


def run_arms(args: argparse.Namespace) -> dict[str, Any]:
    """Each arm in a child process of its own: all at once (the default: every arm sees the same
    host, minute by minute), or one after the other with `--sequential`."""
    command = [sys.executable, __file__, "--minutes", str(args.minutes), "--concurrency", str(args.concurrency)]
    command += ["--backlog", str(args.backlog), "--progress-s", str(args.progress_s), "--server", PG_SERVER]
    files = {arm: ROOT / "var" / f"bench-sustained-{os.getpid()}-{arm}.json" for arm in args.arms}
    children: dict[str, subprocess.Popen[str]] = {}
    echoes: list[threading.Thread] = []

    def echo(child: subprocess.Popen[str]) -> None:
        assert child.stdout is not None
        for line in child.stdout:
            say(line.rstrip("\n"))

    def start(arm: str) -> None:
        child = subprocess.Popen(
            [*command, "--child", arm, "--json", str(files[arm])],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        children[arm] = child
        echoes.append(threading.Thread(target=echo, args=(child,), daemon=True))
        echoes[-1].start()

    try:
        for arm in args.arms:
            start(arm)
            if args.sequential:
                children[arm].wait()
        for child in children.values():
            child.wait()
        for thread in echoes:
            thread.join(10)
        failed = [arm for arm, child in children.items() if child.returncode != 0]
        if failed:
            raise SystemExit(f"arm(s) {', '.join(failed)} failed")
        return {arm: json.loads(path.read_text()) for arm, path in files.items()}
    finally:
        for child in children.values():
            if child.poll() is None:
                child.terminate()
                child.wait(60)
        for path in files.values():
            path.unlink(missing_ok=True)


def main() -> None:
    args = parse_args()
    global PG_SERVER
    PG_SERVER = args.server.rstrip("/")
    (ROOT / "var").mkdir(exist_ok=True)
    if args.child:
        run_child(args.child, args)
        return
    say(f"sustained queued one-step workflows on PostgreSQL: per arm 1 durable_worker x {args.concurrency} threads,")
    say(f"queue concurrency {args.concurrency}, db transport + db admission, {os.cpu_count()} CPUs;", end=" ")
    say(f"arms {', '.join(args.arms)} ({'one after the other' if args.sequential else 'side by side'})")
    autovacuum, naptime = pg_admin("SHOW autovacuum")[0][0], pg_admin("SHOW autovacuum_naptime")[0][0]
    say(f"server {PG_SERVER}: autovacuum {autovacuum} (naptime {naptime})")
    results: dict[str, Any] = {
        "autovacuum": autovacuum,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "backlog": args.backlog,
        "side_by_side": not args.sequential,
        "arms": run_arms(args),
    }
    arms = results["arms"]
    say("per minute, wf/s (of the arm's own first minute):")
    say("  minute " + " ".join(f"{arm:>17}" for arm in arms))
    for index in range(min(len(result["minutes"]) for result in arms.values())):
        cells = []
        for result in arms.values():
            rate = result["minutes"][index]["rate"]
            cells.append(f"{rate:8.1f} ({rate / result['first']:4.2f})")
        say(f"  {index + 1:>6} " + " ".join(f"{cell:>17}" for cell in cells))
    say(
        f"summary (each arm against its own first minute; target, on the tuned arm: {GOAL_MINUTES} minutes, "
        "every minute within 10 % of the first):"
    )
    for arm, result in arms.items():
        first, last, worst = result["first"], result["last"], result["worst"]
        verdict = "held" if worst >= GOAL_WORST_OF_FIRST * first else "FELL"
        tables = result["minutes"][-1]["tables"]
        dead = ", ".join(f"{short(t)} {tables[t]['dead']}" for t in TABLES[:3] if t in tables)
        say(f"  {arm:<9} first {first:6.1f} wf/s, last {last:6.1f} ({last / first:.2f}), worst minute", end=" ")
        say(f"{worst / first:.2f}: {verdict}; dead rows at the end: {dead}")
    lines, targets = [], []
    for arm, result in arms.items():
        first, worst = result["first"], result["worst"]
        lines.append(f"{arm}: first minute {first:.1f} wf/s, worst minute {worst / first:.2f} of it")
        if arm == "tuned":
            minutes = len(result["minutes"])
            name = f"tuned: worst minute / first minute, over {minutes} minutes"
            targets.append(reporting.target(name, worst / first, ">=", GOAL_WORST_OF_FIRST))
            targets.append(reporting.target("tuned: minutes of load", minutes, ">=", GOAL_MINUTES))
    if "baseline" in arms and len(arms) > 1:
        base = arms["baseline"]
        for arm, result in arms.items():
            if arm != "baseline":
                totals = sum(m["rate"] for m in result["minutes"]) / sum(m["rate"] for m in base["minutes"])
                say(f"  {arm} / baseline, workflows over the whole run: {totals:.2f}")
                lines.append(f"{arm} / baseline, workflows over the whole run: {totals:.2f}")
    reporting.write_json("sustained", results, path=args.json, summary=lines, targets=targets)


if __name__ == "__main__":
    main()
