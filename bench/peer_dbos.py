#!/usr/bin/env python
"""Queued one-step workflows: durable_flow vs DBOS Transact, side by side on one database kind.

    .venv/bin/python bench/peer_dbos.py                 # SQLite
    .venv/bin/python bench/peer_dbos.py --postgres      # PostgreSQL

DBOS is not a dependency of durable_flow and this script installs nothing. It runs DBOS when
the `dbos` package is importable, here or in the interpreter `--dbos-python` names (default
`var/dbos-venv/bin/python` when it exists). To get one:

    python3 -m venv var/dbos-venv && var/dbos-venv/bin/pip install dbos

Design. Both run `--runs` (500) one-step no-op workflows (the step returns its input) through
one queue of concurrency 10, on the same kind of database (a fresh SQLite file under `var/`,
or a fresh PostgreSQL database), with their workers started before the clock:

* durable_flow: the embedded default (`db` transport, `db` admission); one `durable_worker`
  process (`--concurrency 10` threads) is started and has heartbeated before the clock starts;
  then this process starts the runs (`tests.queued` on queue `bench-peer`) and counts completed
  runs every 10 ms until all are done.
* DBOS: `DBOS.launch()` (its queue thread is the worker) and `DBOS.register_queue(...,
  concurrency=10, polling_interval_sec=--dbos-poll-s)` before the clock; then the same process
  enqueues the workflows and waits for every result. DBOS dequeues once per polling interval
  (1 s by default, which caps it at 10 workflows/s here); 0.1 s, the `db` transport's own idle
  poll, is the default of this script.

Each side's clock runs from the first start/enqueue to the last completion. The two are timed
`--rounds` times (3), alternately (durable_flow, DBOS, durable_flow, ...), each timing in a
process of its own on a fresh database; the ratio is the median of each round's ratio
durable_flow / DBOS (the goal, `GOAL_RATIO`: at least 3), the worst round printed beside it: a
shared host's speed moves within minutes, so one pair of timings says little.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it
from services import fresh_database, fresh_sqlite, pg_admin, start_worker  # noqa: E402 - bench/ is on the path of a script run from it

PG_SERVER = "postgres://postgres@127.0.0.1:5432"
DF_DATABASE = "durable_flow_bench_peer"
DBOS_DATABASE = "durable_flow_bench_peer_dbos"
QUEUE = "bench-peer"
DEFAULT_DBOS_PYTHON = ROOT / "var" / "dbos-venv" / "bin" / "python"
#: durable_flow / DBOS, queued one-step workflows, the median of the rounds: at least this.
GOAL_RATIO = 3.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL instead of SQLite")
    parser.add_argument("--runs", type=int, default=500, help="workflows per contender")
    parser.add_argument("--concurrency", type=int, default=10, help="the queue's concurrency")
    parser.add_argument("--dbos-poll-s", type=float, default=0.1, help="DBOS queue polling interval (s)")
    parser.add_argument("--dbos-python", default=str(DEFAULT_DBOS_PYTHON), help="an interpreter with `dbos`")
    parser.add_argument(
        "--baseline-tree",
        help="another checkout of durable_flow (this script copied into its bench/), measured in the same run",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating timings of each (the median ratio)")
    parser.add_argument("--only", choices=("durable_flow", "dbos"), help="run one contender (internal use)")
    reporting.add_json_option(parser, "peer_dbos")
    return parser.parse_args()


# -- DBOS ----------------------------------------------------------------------------------------
def run_dbos(args: argparse.Namespace) -> float:
    """Workflows per second through a DBOS queue (in this interpreter, which has `dbos`)."""
    from dbos import DBOS

    url = fresh_database(args.postgres, DBOS_DATABASE, ROOT / "var" / "bench-peer-dbos.sqlite3")

    @DBOS.step()
    def noop_step(value: int) -> int:
        return value

    @DBOS.workflow()
    def one_step(value: int) -> int:
        return noop_step(value)

    DBOS(config={"name": "durable-flow-peer", "system_database_url": url, "log_level": "WARNING"})
    DBOS.launch()
    try:
        queue = DBOS.register_queue(QUEUE, concurrency=args.concurrency, polling_interval_sec=args.dbos_poll_s)
        time.sleep(1.5)  # the queue thread picks the new queue up (it checks every second)
        started = time.perf_counter()
        handles = [queue.enqueue(one_step, i) for i in range(args.runs)]
        results = [handle.get_result() for handle in handles]
        elapsed = time.perf_counter() - started
        if results != list(range(args.runs)):
            raise SystemExit("DBOS returned wrong results")
    finally:
        DBOS.destroy()
        if args.postgres:
            pg_admin(f"DROP DATABASE IF EXISTS {DBOS_DATABASE} WITH (FORCE)")
    return args.runs / elapsed


def dbos_python(args: argparse.Namespace) -> str | None:
    """An interpreter with `dbos`: this one if it imports it, else `--dbos-python`; None if neither."""
    try:
        import dbos  # noqa: F401
    except ImportError:
        return args.dbos_python if Path(args.dbos_python).exists() else None
    return sys.executable


def contender(
    python: str, who: str, args: argparse.Namespace, script: Path = Path(__file__)
) -> tuple[float, list[str]]:
    """One timing of `who` in a process of its own (Django and DBOS set up once a process):
    workflows per second and the lines it printed before its result."""
    command = [python, str(script), "--only", who, "--runs", str(args.runs), "--concurrency", str(args.concurrency)]
    command += ["--dbos-poll-s", str(args.dbos_poll_s)]
    if args.postgres:
        command.append("--postgres")
    # The DBOS interpreter needs psycopg for PostgreSQL; dbos depends on it.
    # Its stderr (progress, errors) goes through to this process's.
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, cwd=script.parent.parent).stdout
    lines = out.strip().splitlines()
    return float(json.loads(lines[-1])["rate"]), [line.strip() for line in lines[:-1]]


# -- durable_flow --------------------------------------------------------------------------------
def run_durable_flow(args: argparse.Namespace) -> float:
    """Workflows per second through a durable_flow queue (db transport + db admission)."""
    os.environ.update(
        {
            "DURABLE_FLOW_TEST_ID": "bench-peer",
            "DJANGO_SETTINGS_MODULE": "settings.test",
            "DJANGO_DEBUG": "0",  # as deployed: DEBUG logs every query's SQL (bench/fleet.py)
            "DURABLE_FLOW_TRANSPORT": "db",
            "DURABLE_FLOW_ADMISSION": "db",
            "DURABLE_FLOW_LOG": "WARNING",
        }
    )
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    if args.postgres:
        pg_admin(f"DROP DATABASE IF EXISTS {DF_DATABASE} WITH (FORCE)")
        pg_admin(f"CREATE DATABASE {DF_DATABASE}")
        os.environ["DATABASE_URL"] = f"{PG_SERVER}/{DF_DATABASE}"
    else:
        os.environ.pop("DATABASE_URL", None)
        from settings.base import VAR_DIR

        fresh_sqlite(VAR_DIR / "test-bench-peer.sqlite3")

    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from django.db import connections

    from durable_flow.config.queues import QueueConfig
    from durable_flow.engine import get_engine
    from durable_flow.models import RunStatus, WorkerHeartbeat, WorkflowRun

    engine = get_engine()
    engine.register_queue(QueueConfig.from_mapping({"name": QUEUE, "concurrency": args.concurrency}))
    worker = start_worker(args.concurrency)
    try:
        deadline = time.monotonic() + 120
        while not WorkerHeartbeat.objects.filter(stopped_at__isnull=True).exists():
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the durable_worker did not start")
            time.sleep(0.05)
        time.sleep(0.5)
        completed = WorkflowRun.objects.filter(status=RunStatus.COMPLETED)
        started = time.perf_counter()
        for i in range(args.runs):
            engine.start("tests.queued", {"queue": QUEUE, "value": i})
        deadline = time.monotonic() + 600
        shown = reporting.Progress("durable_flow", total=args.runs, unit="runs completed")
        while (done := completed.count()) < args.runs:
            shown.update(done)
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"durable_flow: {completed.count()} of {args.runs} completed")
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
        outputs = sorted(WorkflowRun.objects.values_list("output", flat=True))
        if outputs != list(range(args.runs)):
            raise SystemExit("durable_flow returned wrong results")
        turns = sorted(WorkflowRun.objects.values_list("turns", flat=True))
    finally:
        worker.terminate()
        worker.wait(60)
        connections.close_all()
        if args.postgres:
            pg_admin(f"DROP DATABASE IF EXISTS {DF_DATABASE} WITH (FORCE)")
    print(f"  durable_flow turns per run: median {turns[len(turns) // 2]}, max {turns[-1]}")
    return args.runs / elapsed


def main() -> None:
    args = parse_args()
    if args.only == "dbos":
        print(json.dumps({"rate": run_dbos(args)}))
        return
    if args.only == "durable_flow":
        print(json.dumps({"rate": run_durable_flow(args)}))
        return
    kind = "PostgreSQL" if args.postgres else "SQLite"
    print(f"{args.runs} one-step no-op workflows, queue concurrency {args.concurrency}, {kind}, {os.cpu_count()} CPUs")
    theirs_python = dbos_python(args)
    ours: list[float] = []
    theirs: list[float] = []
    for round_no in range(1, args.rounds + 1):
        reporting.log(f"round {round_no} of {args.rounds}: durable_flow" + (", then DBOS" if theirs_python else ""))
        rate, lines = contender(sys.executable, "durable_flow", args)
        ours.append(rate)
        note = f"; {lines[-1]}" if lines else ""
        if theirs_python is None:
            print(f"  round {round_no}: durable_flow {rate:.1f} wf/s{note}")
            continue
        theirs.append(contender(theirs_python, "dbos", args)[0])
        print(f"  round {round_no}: durable_flow {rate:.1f} wf/s, DBOS {theirs[-1]:.1f} wf/s{note}")
    ours_line = (
        f"durable_flow (db transport + db admission, 1 worker process): {median(ours):7.1f} workflows/s (median)"
    )
    print(f"  {ours_line}")
    figures: dict[str, object] = {
        "database": kind,
        "runs": args.runs,
        "concurrency": args.concurrency,
        "durable_flow_wf_s": ours,
        "durable_flow_median": median(ours),
    }
    summary = [ours_line]
    if args.baseline_tree:
        tree = Path(args.baseline_tree).resolve()
        python = str(tree / ".venv" / "bin" / "python")
        base, lines = contender(python, "durable_flow", args, tree / "bench" / "peer_dbos.py")
        print(f"  durable_flow baseline ({tree.name}; {lines[0] if lines else ''}): {base:7.1f} workflows/s")
        print(f"  this tree / baseline: {median(ours) / base:.2f}")
        figures["baseline_wf_s"] = base
        summary.append(f"this tree / baseline ({tree.name}): {median(ours) / base:.2f}")
    targets = []
    if theirs_python is None:
        print(
            f"  DBOS: not installed (see this script's docstring); no ratio, the goal (>= {GOAL_RATIO:g}) not measured"
        )
        summary.append(f"DBOS: not installed; no ratio (goal >= {GOAL_RATIO:g} not measured)")
        # Recorded unmeasured (never met): a run without DBOS has not shown the goal.
        targets.append(reporting.target("durable_flow / DBOS, median of the rounds", None, ">=", GOAL_RATIO))
    else:
        label = f"DBOS Transact (queue polling {args.dbos_poll_s} s):"
        print(f"  {label:<62}{median(theirs):7.1f} workflows/s (median)")
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        verdict = "met" if median(ratios) >= GOAL_RATIO else "NOT met"
        lines = [
            f"{label} {median(theirs):.1f} workflows/s (median)",
            f"rounds' ratios: {' / '.join(f'{r:.2f}' for r in ratios)}",
            f"ratio durable_flow / DBOS, median of the rounds: {median(ratios):.2f} "
            f"(goal >= {GOAL_RATIO:g}: {verdict})",
            f"worst round: {min(ratios):.2f}",
        ]
        print("\n".join(f"  {line}" for line in lines[1:]))
        summary += lines
        figures.update(
            {
                "dbos_poll_s": args.dbos_poll_s,
                "dbos_wf_s": theirs,
                "dbos_median": median(theirs),
                "ratios": ratios,
                "ratio": median(ratios),
                "worst": min(ratios),
            }
        )
        targets.append(reporting.target("durable_flow / DBOS, median of the rounds", median(ratios), ">=", GOAL_RATIO))
    reporting.write_json("peer_dbos", figures, path=args.json, summary=summary, targets=targets)


if __name__ == "__main__":
    main()
