#!/usr/bin/env python
"""Idle latency: start → step start and start → result visible, per stack, beside DBOS.

    .venv/bin/python bench/latency.py                        # every stack, ~3 minutes
    .venv/bin/python bench/latency.py --stacks sqlite --runs 100 --json var/latency.json

A stack is what a deployment picks: `pg` (PostgreSQL, `db` transport and `db` admission),
`sqlite` (SQLite, the same), `rq` (PostgreSQL, `rq` transport and `redis` admission; the Redis
database of `--redis-url`, its `rq:*` and admission keys cleared: one no other process may use
meanwhile, and the bench refuses one another client is connected to). For each, in a process
of its own on a fresh database, one `durable_worker` process (`--concurrency` threads) is
started and has heartbeated before the clock; then:

* idle: `--runs` one-step workflows (`tests.stamped`: its step, through a queue of concurrency
  10, returns `time.time()` when it began) started one after another, each once the previous
  one's result was seen, with a random pause of 20-150 ms between them (so the worker is idle in
  its wait, and the starts fall anywhere in its poll interval). Start → step start is the step's
  stamp less the wall clock just before `start`; start → result is the wall clock once the caller
  saw the run completed, through `durable_flow.wait` where this tree has it, else by reading the
  run every millisecond (as a caller with no wait API would do at best).
* load: the stack's capacity is measured first (`--burst` workflows started in one transaction,
  first to last completion); then workflows are started open loop, evenly spaced at half that
  rate for `--load-s` seconds, and each one's start → step start and start → finish (the run's
  `finished_at` less the start) are taken from its rows once all completed.

DBOS (when importable here or in `--dbos-python`, default `var/dbos-venv/bin/python`; see
`bench/peer_dbos.py` for how to get one; skipped with a note otherwise) runs the same one-step
workflow on the same database kinds, idle: enqueued on a queue polled every `--dbos-poll-s`
(0.1 s), and called directly (no queue), its result taken with `handle.get_result()`.

The stacks are measured `--rounds` times, alternately (pg, sqlite, rq, pg, ...), and each
figure printed is the median over the rounds of that round's percentile (a shared host's speed
moves within minutes), the worst round beside it. `--json PATH` writes every figure, each
round's included, as one JSON object.

The targets, on every stack (the `GOAL_*` constants): idle start → step start p50 <= 3 ms and
p99 <= 15 ms; start → result seen within 2 ms more (p50 <= 5 ms, p99 <= 17 ms; each run's step
start → result seen is printed beside it); under the steady half load, start → step start
p99 <= 30 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it
from services import (  # noqa: E402 - bench/ is on the path of a script run from it
    django_on_fresh_database,
    fresh_database,
    percentiles,
    pg_admin,
    require_own_redis_database,
    start_worker,
)

DF_DATABASE = f"durable_flow_bench_latency_{os.getpid()}"
DBOS_DATABASE = f"durable_flow_bench_latency_dbos_{os.getpid()}"
QUEUE = "bench-latency"
TEST_ID = "bench-latency"
DEFAULT_DBOS_PYTHON = ROOT / "var" / "dbos-venv" / "bin" / "python"
STACKS = ("pg", "sqlite", "rq")
#: The goals, in milliseconds: idle p50 and p99 of start → step start, the extra allowed to the
#: result seen over them (its p50 <= GOAL_P50_MS + GOAL_RESULT_EXTRA_MS, its p99 likewise), and
#: the step start's p99 under a steady 50 % load.
GOAL_P50_MS, GOAL_P99_MS, GOAL_RESULT_EXTRA_MS, GOAL_LOAD_P99_MS = 3.0, 15.0, 2.0, 30.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated: pg, sqlite, rq")
    parser.add_argument("--runs", type=int, default=200, help="sequential workflows per stack and round (idle)")
    parser.add_argument("--burst", type=int, default=300, help="workflows of the capacity measurement")
    parser.add_argument("--load-s", type=float, default=5.0, help="seconds of steady 50 %% load (0: none)")
    parser.add_argument("--concurrency", type=int, default=10, help="worker threads and the queue's concurrency")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (the medians)")
    parser.add_argument("--dbos-poll-s", type=float, default=0.1, help="DBOS queue polling interval (s)")
    parser.add_argument("--dbos-python", default=str(DEFAULT_DBOS_PYTHON), help="an interpreter with `dbos`")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14"))
    parser.add_argument(
        "--baseline-tree",
        help="another checkout of durable_flow (with this script in its bench/), measured in the same rounds",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        type=Path,
        default=reporting.default_path("latency"),
        help="write the figures as JSON to PATH (default var/bench/latency.json)",
    )
    parser.add_argument("--only", help="measure one stack, or `dbos-pg`/`dbos-sqlite`, in this process (internal)")
    return parser.parse_args()


# -- durable_flow --------------------------------------------------------------------------------
def setup_stack(stack: str, redis_url: str) -> None:
    def clear_redis() -> None:
        import redis

        client = redis.Redis.from_url(redis_url)
        for pattern in ("rq:*", f"df:test:{TEST_ID}*"):
            keys = list(client.scan_iter(pattern, count=1000))
            if keys:
                client.delete(*keys)

    env = {
        "DURABLE_FLOW_TRANSPORT": "rq" if stack == "rq" else "db",
        "DURABLE_FLOW_ADMISSION": "redis" if stack == "rq" else "db",
        "REDIS_URL": redis_url,
    }
    pg_database = None if stack == "sqlite" else DF_DATABASE
    if stack == "rq":
        require_own_redis_database(redis_url)  # before this process connects, or creates its database
    django_on_fresh_database(TEST_ID, pg_database, env, clear_redis if stack == "rq" else None)


def result_waiter() -> tuple[str, Callable[[str], Any]]:
    """How the caller waits for a run's end: `durable_flow.wait` if this tree has it, else a
    read of the run every millisecond."""
    import durable_flow

    if "wait" in getattr(durable_flow, "__all__", ()):
        return "durable_flow.wait", lambda run_id: durable_flow.wait(run_id, timeout=60)

    from durable_flow.models import RunStatus, WorkflowRun

    def poll(run_id: str) -> Any:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            run = WorkflowRun.objects.get(pk=run_id)
            if run.status == RunStatus.COMPLETED:
                return run
            time.sleep(0.001)
        raise SystemExit(f"run {run_id} did not complete")

    return "a read every 1 ms", poll


def stop_waits() -> None:
    """Stop the listener `durable_flow.wait` keeps (where this tree has one) before the database
    is dropped, which would end its connection: its reconnection's warning is no fault."""
    try:
        from durable_flow.store.run_bells import watchers
    except ImportError:
        return
    watchers.stop()


def run_stack(stack: str, args: argparse.Namespace) -> dict[str, Any]:
    setup_stack(stack, args.redis_url)
    from django.db import connections, transaction

    from durable_flow.config.queues import QueueConfig
    from durable_flow.engine import get_engine
    from durable_flow.models import RunStatus, WorkerHeartbeat, WorkflowRun

    engine = get_engine()
    engine.register_queue(QueueConfig.from_mapping({"name": QUEUE, "concurrency": args.concurrency}))
    worker = start_worker(args.concurrency)
    how, wait = result_waiter()
    payload = {"queue": QUEUE}
    out: dict[str, Any] = {"stack": stack, "waiter": how}
    try:
        deadline = time.monotonic() + 120
        while not WorkerHeartbeat.objects.filter(stopped_at__isnull=True).exists():
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the durable_worker did not start")
            time.sleep(0.05)
        # Warm up: the first runs pay for connections, imports and caches on both sides.
        for _ in range(5):
            wait(engine.start("tests.stamped", payload).pk)
        step_s: list[float] = []
        result_s: list[float] = []
        for _ in range(args.runs):
            time.sleep(random.uniform(0.02, 0.15))
            begun = time.time()
            run_id = engine.start("tests.stamped", payload).pk
            wait(run_id)
            seen = time.time()
            stamp = WorkflowRun.objects.values_list("output", flat=True).get(pk=run_id)
            step_s.append(stamp - begun)
            result_s.append(seen - begun)
        out["idle_step"] = percentiles(step_s)
        out["idle_result"] = percentiles(result_s)
        out["idle_step_to_result"] = percentiles([seen - step for step, seen in zip(step_s, result_s, strict=True)])
        if args.load_s > 0:
            completed = WorkflowRun.objects.filter(status=RunStatus.COMPLETED)
            before = completed.count()
            first = time.perf_counter()
            with transaction.atomic():
                for _ in range(args.burst):
                    engine.start("tests.stamped", payload)
            deadline = time.monotonic() + 300
            while completed.count() < before + args.burst:
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{stack}: the burst did not complete")
                time.sleep(0.01)
            capacity = args.burst / (time.perf_counter() - first)
            rate = capacity / 2
            out["capacity_wf_s"] = capacity
            out["load_wf_s"] = rate
            started: dict[str, float] = {}
            count = max(1, round(rate * args.load_s))
            origin = time.perf_counter()
            for i in range(count):
                pause = origin + i / rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                begun = time.time()
                started[engine.start("tests.stamped", payload).pk] = begun
            deadline = time.monotonic() + 300
            while completed.filter(pk__in=list(started)).count() < len(started):
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{stack}: the load did not complete")
                time.sleep(0.05)
            rows = WorkflowRun.objects.filter(pk__in=list(started)).values_list("pk", "output", "finished_at")
            out["load_step"] = percentiles([stamp - started[pk] for pk, stamp, _ in rows])
            out["load_finished"] = percentiles([done.timestamp() - started[pk] for pk, _, done in rows])
    finally:
        worker.terminate()
        worker.wait(60)
        stop_waits()
        connections.close_all()
        if stack != "sqlite":
            pg_admin(f"DROP DATABASE IF EXISTS {DF_DATABASE} WITH (FORCE)")
    return out


# -- DBOS ----------------------------------------------------------------------------------------
def run_dbos(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """DBOS's idle latency, queued and direct, on `kind` (`pg` or `sqlite`)."""
    from dbos import DBOS, SetWorkflowID

    url = fresh_database(kind == "pg", DBOS_DATABASE, ROOT / "var" / "bench-latency-dbos.sqlite3")

    @DBOS.step()
    def stamp_step() -> float:
        return time.time()

    @DBOS.workflow()
    def stamped() -> float:
        return stamp_step()

    DBOS(config={"name": "durable-flow-latency", "system_database_url": url, "log_level": "WARNING"})
    DBOS.launch()
    out: dict[str, Any] = {"stack": f"dbos-{kind}"}
    try:
        queue = DBOS.register_queue(QUEUE, concurrency=args.concurrency, polling_interval_sec=args.dbos_poll_s)
        time.sleep(1.5)  # the queue thread picks the new queue up (it checks every second)
        calls = (("queued", lambda: queue.enqueue(stamped)), ("direct", lambda: DBOS.start_workflow(stamped)))
        for label, call in calls:
            for _ in range(5):
                call().get_result()
            step_s: list[float] = []
            result_s: list[float] = []
            for i in range(args.runs):
                time.sleep(random.uniform(0.02, 0.15))
                with SetWorkflowID(f"{label}-{i}-{os.getpid()}"):
                    begun = time.time()
                    handle = call()
                stamp = handle.get_result()
                seen = time.time()
                step_s.append(stamp - begun)
                result_s.append(seen - begun)
            out[f"{label}_step"] = percentiles(step_s)
            out[f"{label}_result"] = percentiles(result_s)
    finally:
        DBOS.destroy()
        if kind == "pg":
            pg_admin(f"DROP DATABASE IF EXISTS {DBOS_DATABASE} WITH (FORCE)")
    return out


def dbos_python(args: argparse.Namespace) -> str | None:
    """An interpreter with `dbos`: this one if it imports it, else `--dbos-python`; None if neither."""
    try:
        import dbos  # noqa: F401
    except ImportError:
        return args.dbos_python if Path(args.dbos_python).exists() else None
    return sys.executable


# -- the driver ----------------------------------------------------------------------------------
def measure(python: str, only: str, args: argparse.Namespace, script: Path = Path(__file__)) -> dict[str, Any]:
    """One stack's figures, from a process of its own (Django and DBOS set up once a process)."""
    command = [python, str(script), "--only", only, "--runs", str(args.runs), "--burst", str(args.burst)]
    command += ["--load-s", str(args.load_s), "--concurrency", str(args.concurrency)]
    command += ["--dbos-poll-s", str(args.dbos_poll_s), "--redis-url", args.redis_url]
    # stderr passes through: a child's refusal (`require_own_redis_database`) or its warnings are seen.
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, cwd=script.parent.parent).stdout
    return json.loads(out.strip().splitlines()[-1])


def fold(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each percentile's median over the rounds, and its worst round."""
    folded: dict[str, Any] = {"rounds": rounds}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            folded[key] = {stat: median(r[key][stat] for r in rounds) for stat in value if stat != "n"} | {
                f"worst_{stat}": max(r[key][stat] for r in rounds) for stat in value if stat != "n"
            }
        elif isinstance(value, float):
            folded[key] = median(r[key] for r in rounds)
        else:
            folded[key] = value
    return folded


def row(label: str, figures: dict[str, float] | None) -> str:
    if not figures:
        return f"  {label:<40} {'-':>8} {'-':>8} {'-':>8}"
    return (
        f"  {label:<40} {figures['p50']:8.1f} {figures['p99']:8.1f} {figures['max']:8.1f}"
        f"   (worst round p50 {figures['worst_p50']:.1f}, p99 {figures['worst_p99']:.1f})"
    )


def goals(name: str, figures: dict[str, Any]) -> list[dict[str, Any]]:
    """The stack's targets (`reporting.target`), on the medians of the rounds."""
    step, result, load = figures.get("idle_step"), figures.get("idle_result"), figures.get("load_step")
    found = []
    if step:
        found.append(reporting.target(f"{name}: idle start -> step start p50, ms", step["p50"], "<=", GOAL_P50_MS))
        found.append(reporting.target(f"{name}: idle start -> step start p99, ms", step["p99"], "<=", GOAL_P99_MS))
    if result:
        for stat, goal in (("p50", GOAL_P50_MS), ("p99", GOAL_P99_MS)):
            bound = goal + GOAL_RESULT_EXTRA_MS
            found.append(reporting.target(f"{name}: idle start -> result seen {stat}, ms", result[stat], "<=", bound))
    if load:
        found.append(
            reporting.target(f"{name}: start -> step start p99 at half load, ms", load["p99"], "<=", GOAL_LOAD_P99_MS)
        )
    return found


def verdicts(name: str, stack: dict[str, Any]) -> str:
    """The stack's targets as one line: `step p50 <= 3: met, ...`."""
    marks = []
    for entry in goals(name, stack):
        what = entry["name"].removeprefix(f"{name}: ").removesuffix(", ms")
        marks.append(f"{what} <= {entry['bound']:g}: {'met' if entry['met'] else 'NOT met'}")
    return "; ".join(marks)


def write_json(
    args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], tree: Path | None, dbos: str | None
) -> None:
    """Every figure so far, folded over the rounds (each round's kept), as one JSON object."""
    folded = {name: fold(rounds) for name, rounds in results.items()}
    document = {
        "bench": "latency",
        "runs": args.runs,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "goals_ms": {
            "idle_p50": GOAL_P50_MS,
            "idle_p99": GOAL_P99_MS,
            "result_extra": GOAL_RESULT_EXTRA_MS,
            "load_p99": GOAL_LOAD_P99_MS,
        },
        "dbos": "measured" if dbos else "not installed",
        "stacks": {name: figures for name, figures in folded.items() if not name.startswith("baseline-")},
        "baseline": {
            "tree": str(tree) if tree else None,
            "stacks": {
                name.removeprefix("baseline-"): figures
                for name, figures in folded.items()
                if name.startswith("baseline-")
            },
        },
    }
    targets, summary = [], []
    for name, figures in document["stacks"].items():
        if name.startswith("dbos-"):
            continue
        step, result = figures.get("idle_step") or {}, figures.get("idle_result") or {}
        if step and result:
            summary.append(
                f"{name}: idle start -> step start p50 {step['p50']:.1f} ms, p99 {step['p99']:.1f} ms; "
                f"-> result seen p50 {result['p50']:.1f} ms, p99 {result['p99']:.1f} ms"
            )
        load = figures.get("load_step")
        if load:
            summary.append(f"{name}: at half load, start -> step start p99 {load['p99']:.1f} ms")
        targets += goals(name, figures)
    for name, figures in document["stacks"].items():
        queued = figures.get("queued_step") if name.startswith("dbos-") else None
        if queued:
            summary.append(f"DBOS on {name.removeprefix('dbos-')}, queued: start -> step p50 {queued['p50']:.1f} ms")
    if dbos is None:
        summary.append("DBOS: not installed; not measured")
    reporting.write_json("latency", document, path=args.json_path, summary=summary, targets=targets)


def main() -> None:
    args = parse_args()
    if args.only:
        if args.only.startswith("dbos-"):
            figures = run_dbos(args.only.removeprefix("dbos-"), args)
        else:
            figures = run_stack(args.only, args)
        print(json.dumps(figures))
        return
    stacks = [name.strip() for name in args.stacks.split(",") if name.strip()]
    unknown = set(stacks) - set(STACKS)
    if unknown:
        raise SystemExit(f"unknown stacks: {sorted(unknown)}")
    theirs_python = dbos_python(args)
    dbos_kinds = sorted({"pg" if stack in ("pg", "rq") else "sqlite" for stack in stacks}) if theirs_python else []
    print(
        f"Idle latency, queued one-step workflows, one worker process ({args.concurrency} threads), "
        f"{args.runs} runs a round, {args.rounds} rounds, {os.cpu_count()} CPUs"
    )
    results: dict[str, list[dict[str, Any]]] = {}
    tree = Path(args.baseline_tree).resolve() if args.baseline_tree else None
    contenders = [*stacks, *(f"dbos-{kind}" for kind in dbos_kinds)]
    if tree is not None:  # each stack's baseline right after it, on the same host's minute
        contenders = [name for stack in stacks for name in (stack, f"baseline-{stack}")] + contenders[len(stacks) :]
    for round_no in range(1, args.rounds + 1):
        for name in contenders:
            python = theirs_python if name.startswith("dbos-") else sys.executable
            script = Path(__file__)
            if name.startswith("baseline-"):
                assert tree is not None
                python, script = str(tree / ".venv" / "bin" / "python"), tree / "bench" / "latency.py"
            assert python is not None
            began = time.monotonic()
            figures = measure(python, name.removeprefix("baseline-"), args, script)
            results.setdefault(name, []).append(figures)
            write_json(args, results, tree, theirs_python)  # after every contender: a cut-short run keeps it
            step = figures.get("idle_step") or figures.get("queued_step")
            print(
                f"  round {round_no} {name}: step p50 {step['p50']:.1f} ms, p99 {step['p99']:.1f} ms "
                f"({time.monotonic() - began:.0f} s)",
                flush=True,
            )
    folded = {name: fold(rounds) for name, rounds in results.items()}
    print()
    print(f"  {'milliseconds (median of rounds)':<40} {'p50':>8} {'p99':>8} {'max':>8}")
    labels = {"pg": "PostgreSQL db", "sqlite": "SQLite db", "rq": "rq + redis admission (PostgreSQL)"}
    shown = [name for stack in stacks for name in (stack, f"baseline-{stack}") if name in folded]
    for name in shown:
        stack = folded[name]
        base = name.startswith("baseline-")
        label = f"{labels[name.removeprefix('baseline-')]}{', BASELINE ' + tree.name if base and tree else ''}"
        print(f"  {label} (caller waits by {stack['waiter']})")
        print(row("  idle: start -> step start", stack.get("idle_step")))
        print(row("  idle: start -> result seen", stack.get("idle_result")))
        print(row("  idle: step start -> result seen", stack.get("idle_step_to_result")))
        if "load_step" in stack:
            print(f"    under load: {stack['load_wf_s']:.0f} wf/s (half of {stack['capacity_wf_s']:.0f} wf/s)")
            print(row("  load: start -> step start", stack.get("load_step")))
            print(row("  load: start -> run finished", stack.get("load_finished")))
        print(f"    goals: {verdicts(name, stack)}")
    for kind in dbos_kinds:
        stack = folded[f"dbos-{kind}"]
        print(f"  DBOS on {'PostgreSQL' if kind == 'pg' else 'SQLite'}")
        print(row(f"  queued ({args.dbos_poll_s} s poll): start -> step", stack.get("queued_step")))
        print(row("  queued: start -> result", stack.get("queued_result")))
        print(row("  direct: start -> step start", stack.get("direct_step")))
        print(row("  direct: start -> result", stack.get("direct_result")))
    if not theirs_python:
        print("  DBOS: not installed (see bench/peer_dbos.py's docstring); not measured")
    print("  (figures from one host; on a shared one, compare within a run)")
    if tree is not None:
        print("  this tree / baseline, median of the rounds' ratios (below 1: faster here):")
        for stack in stacks:
            ours, theirs = results[stack], results[f"baseline-{stack}"]
            for key, what in (("idle_step", "idle step start"), ("idle_result", "idle result seen")):
                for stat in ("p50", "p99"):
                    ratios = [a[key][stat] / b[key][stat] for a, b in zip(ours, theirs, strict=False)]
                    print(f"    {labels[stack]:<36} {what:<18} {stat}: {median(ratios):.2f} (worst {max(ratios):.2f})")
    write_json(args, results, tree, theirs_python)


if __name__ == "__main__":
    main()
