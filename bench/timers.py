#!/usr/bin/env python
"""Timer lateness: how long after its due time a sleep or a retry's backoff resumes.

    .venv/bin/python bench/timers.py                          # pg and sqlite, ~2 minutes
    .venv/bin/python bench/timers.py --stacks sqlite --runs 50 --baseline-tree /tmp/before

For each stack (`pg`: PostgreSQL, `sqlite`: SQLite; both on the `db` transport and `db`
admission), in a process of its own on a fresh database, one `durable_worker` and one
`durable_poller` (at `--interval-ms`, 500 by default as in production) are started; then
`--runs` workflows of each kind are run one after another, each started once the previous one
was seen finished (`durable_flow.wait`), with a random pause of 20-150 ms between them:

* sleep: `tests.sleep_then_stamp` sleeps `--sleep-ms` (50) then runs a step that returns
  `time.time()` when it began; lateness is that stamp less the sleep's due time (its
  checkpoint's `wait_detail["until"]`, kept to the millisecond: the figure is at most 1 ms high);
* backoff: `tests.backoff_then_stamp`'s step fails its first attempt (backoff 50 ms) and its
  second returns when it began; lateness is that stamp less the first attempt's `retry_at`.

The lateness is the time from the due time to the resumed step: the poller's wake-up, its turn
task, a worker's claim and the turn that dispatches the step. `--baseline-tree` measures another
checkout in the same rounds, each stack's baseline right after it (that checkout needs this
tree's `bench/timers.py`, `bench/services.py`, `bench/reporting.py`, `tests/workflows.py` and
`settings/test.py` copied in: the workflows and the poller's interval setting). The figures
printed are the median over `--rounds` of each round's percentile, the worst round beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it
from services import django_on_fresh_database, percentiles, pg_admin, stop  # noqa: E402 - bench/ is on the path of a script run from it

DF_DATABASE = f"durable_flow_bench_timers_{os.getpid()}"
TEST_ID = "bench-timers"
STACKS = ("pg", "sqlite")
KINDS = ("sleep", "backoff")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated: pg, sqlite")
    parser.add_argument("--runs", type=int, default=60, help="sequential workflows of each kind, per stack and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (the medians)")
    parser.add_argument("--interval-ms", type=int, default=500, help="the poller's interval (POLLER INTERVAL_MS)")
    parser.add_argument("--sleep-ms", type=int, default=50, help="the sleep of the sleep workflow")
    parser.add_argument("--baseline-tree", help="another checkout of durable_flow, measured in the same rounds")
    reporting.add_json_option(parser, "timers")
    parser.add_argument("--only", help="measure one stack in this process (internal)")
    return parser.parse_args()


def setup_stack(stack: str, interval_ms: int) -> None:
    env = {
        "DURABLE_FLOW_TRANSPORT": "db",
        "DURABLE_FLOW_ADMISSION": "db",
        "DURABLE_FLOW_POLLER_INTERVAL_MS": str(interval_ms),
    }
    django_on_fresh_database(TEST_ID, None if stack == "sqlite" else DF_DATABASE, env)


def manage(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run_stack(stack: str, args: argparse.Namespace) -> dict[str, Any]:
    setup_stack(stack, args.interval_ms)
    from django.db import connections

    import durable_flow
    from durable_flow.models import RunStatus, StepAttempt, StepCheckpoint, StepKind, WorkerHeartbeat

    worker = manage("durable_worker", "--concurrency", "4")
    procs = [worker, manage("durable_poller", "--interval-ms", str(args.interval_ms))]
    out: dict[str, Any] = {"stack": stack, "interval_ms": args.interval_ms}
    try:
        deadline = time.monotonic() + 120
        while not WorkerHeartbeat.objects.filter(stopped_at__isnull=True).exists():
            if any(proc.poll() is not None for proc in procs) or time.monotonic() > deadline:
                raise SystemExit("the durable_worker did not start")
            time.sleep(0.05)

        def sleep_lateness() -> float:
            run = durable_flow.start("tests.sleep_then_stamp", {"s": args.sleep_ms / 1000})
            run = durable_flow.wait(run.id, timeout=60)
            assert run.status == RunStatus.COMPLETED, run.error
            until = StepCheckpoint.objects.get(run_id=run.id, kind=StepKind.SLEEP).wait_detail["until"]
            return float(run.output) - datetime.fromisoformat(until).timestamp()

        def backoff_lateness() -> float:
            run = durable_flow.start("tests.backoff_then_stamp", None)
            run = durable_flow.wait(run.id, timeout=60)
            assert run.status == RunStatus.COMPLETED, run.error
            due = StepAttempt.objects.get(run_id=run.id, attempt=1).retry_at
            return float(run.output) - due.timestamp()

        for kind, measure in (("sleep", sleep_lateness), ("backoff", backoff_lateness)):
            for _ in range(3):  # warm-up: connections, imports, caches on both sides
                measure()
            lateness: list[float] = []
            for _ in range(args.runs):
                time.sleep(random.uniform(0.02, 0.15))
                lateness.append(measure())
            out[kind] = percentiles(lateness)
    finally:
        stop(procs, 60)
        connections.close_all()
        if stack != "sqlite":
            pg_admin(f"DROP DATABASE IF EXISTS {DF_DATABASE} WITH (FORCE)")
    return out


def measure(only: str, args: argparse.Namespace, tree: Path = ROOT) -> dict[str, Any]:
    """One stack's figures from a process of its own, with `tree`'s code."""
    python = str(tree / ".venv" / "bin" / "python") if tree != ROOT else sys.executable
    command = [python, str(tree / "bench" / "timers.py"), "--only", only, "--runs", str(args.runs)]
    command += ["--interval-ms", str(args.interval_ms), "--sleep-ms", str(args.sleep_ms)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def fold(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each kind's percentiles: the median over the rounds, and the worst round."""
    folded: dict[str, Any] = {"rounds": rounds}
    for kind in KINDS:
        stats = ("p50", "p99", "max")
        folded[kind] = {stat: median(r[kind][stat] for r in rounds) for stat in stats} | {
            f"worst_{stat}": max(r[kind][stat] for r in rounds) for stat in stats
        }
    return folded


def main() -> None:
    args = parse_args()
    if args.only:
        print(json.dumps(run_stack(args.only, args)))
        return
    stacks = [name.strip() for name in args.stacks.split(",") if name.strip()]
    if set(stacks) - set(STACKS):
        raise SystemExit(f"unknown stacks: {sorted(set(stacks) - set(STACKS))}")
    tree = Path(args.baseline_tree).resolve() if args.baseline_tree else None
    print(
        f"Timer lateness (due -> resumed step), poller interval {args.interval_ms} ms, sleep {args.sleep_ms} ms, "
        f"backoff 50 ms, {args.runs} runs a kind, {args.rounds} rounds, {os.cpu_count()} CPUs",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {}
    for round_no in range(1, args.rounds + 1):
        for stack in stacks:
            for name, where in ((stack, ROOT), *(((f"baseline-{stack}", tree),) if tree else ())):
                began = time.monotonic()
                figures = measure(stack, args, where)
                results.setdefault(name, []).append(figures)
                print(
                    f"  round {round_no} {name}: sleep p50 {figures['sleep']['p50']:.1f} ms, "
                    f"backoff p50 {figures['backoff']['p50']:.1f} ms ({time.monotonic() - began:.0f} s)",
                    flush=True,
                )
    folded = {name: fold(rounds) for name, rounds in results.items()}
    print()
    print(f"  {'milliseconds late (median of rounds)':<44} {'p50':>8} {'p99':>8} {'max':>8}")
    labels = {"pg": "PostgreSQL db", "sqlite": "SQLite db"}
    summary: list[str] = []
    targets: list[dict[str, Any]] = []
    for name, figures in folded.items():
        base = name.startswith("baseline-")
        label = labels[name.removeprefix("baseline-")] + (f", BASELINE {tree.name}" if base and tree else "")
        print(f"  {label}")
        for kind in KINDS:
            f = figures[kind]
            print(
                f"    {kind:<40} {f['p50']:8.1f} {f['p99']:8.1f} {f['max']:8.1f}"
                f"   (worst round p50 {f['worst_p50']:.1f}, p99 {f['worst_p99']:.1f})"
            )
            if not base:
                summary.append(f"{name} {kind}: p50 {f['p50']:.1f} ms, p99 {f['p99']:.1f} ms late")
                # Resumed well within one interval: the poller woke at the due time, not its tick.
                targets.append(reporting.target(f"{name}: {kind} p99 late, ms", f["p99"], "<", args.interval_ms / 5))
    if tree is not None:
        print("  this tree / baseline, median of the rounds' ratios (below 1: sooner here):")
        for stack in stacks:
            for kind in KINDS:
                for stat in ("p50", "p99"):
                    ratios = [
                        a[kind][stat] / b[kind][stat]
                        for a, b in zip(results[stack], results[f"baseline-{stack}"], strict=True)
                    ]
                    print(f"    {labels[stack]:<16} {kind:<8} {stat}: {median(ratios):.2f} (worst {max(ratios):.2f})")
    reporting.write_json(
        "timers",
        {"interval_ms": args.interval_ms, "sleep_ms": args.sleep_ms, "runs": args.runs, "stacks": folded},
        path=args.json,
        summary=summary,
        targets=targets,
    )


if __name__ == "__main__":
    main()
