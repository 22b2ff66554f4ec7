#!/usr/bin/env python
"""Flow control under contention: handoff throughput, turns per parked run, rate limits at step
start, and what 10,000 parked waiters cost, with real worker and poller processes.

    .venv/bin/python bench/contention.py                        # all three stacks, 3 rounds
    .venv/bin/python bench/contention.py --quick                # CI smoke: 60 runs, 2 rounds
    .venv/bin/python bench/contention.py --stacks db-sqlite,rq-redis --rounds 5

Stacks (each in a child process, on its own throwaway database):
  db-sqlite    `db` transport + `db` admission on SQLite (a fresh var/ file, deleted after)
  db-postgres  `db` transport + `db` admission on PostgreSQL (a database created and dropped here)
  rq-redis     `rq` transport + `redis` admission on PostgreSQL (RQ on `--redis-url`, default db 14;
               its `rq:*` keys are cleared, admission keys live under a unique prefix)

Per stack, 2 `durable_worker --concurrency 4` processes and a `durable_poller` are started, and
once both workers heartbeat, runs of `tests.queued` are created (in one transaction: the whole
backlog appears at once) and run to completion. The step
(`tests.slow`) stamps the instant it is called and returns, so every figure below is read from
what the step saw, against its theoretical value in the same run:

  cap      concurrency 2, 50 ms steps, 200 runs over 4 fairness keys (`fairness="key"`):
           steps/s between the 10 % and 90 % start marks vs 2 / 50 ms = 40/s (target: the
           median of the rounds >= 0.95 of it, the worst round >= 0.9; the ceiling 2 / measured
           step time is shown too), turns per run from `WorkflowRun.turns` (target max <= 3,
           however long the run waited), and the most steps ever running at once (must be <= 2
           in every round).
  sliding  20 per 1,000 ms, 200 runs: starts/s after the first window's 20, (N - 20) / (last start
           - first start), vs 20/s (target: median >= 0.95, worst round >= 0.9); the pace from
           the first window's last start on is shown beside it; the most starts in any trailing
           1,000 ms (must be <= 20 in every round).
  fixed    20 per 1,000 ms, 200 runs: the most starts in one aligned 1,000 ms window (must be
           <= 20 in every round), and starts/s after the first window vs 20/s.
  parked   one queue (concurrency 5, every slot held) with 100 and then 10,000 waiters, each a
           real parked run (a suspended run and a `waiting` checkpoint) and a waiter in the
           backend: the median time of one admission decision (`try_admit` of a new caller, which
           parks), of one release + grant (the freed slot goes to the next of the waiters in the
           same call), and of one poller tick (`TimerPoller.tick()` + `grant_queues()`); ratio
           10,000 / 100 (target <= 1.5). Backends: `local` and `db` in the SQLite child, `db` in
           the PostgreSQL child, `redis` in the rq-redis child (its tick on PostgreSQL). Measured
           in the first round only: its figure is a ratio within one child.

The stacks run `--rounds` times, alternately (db-sqlite, db-postgres, rq-redis, then the other
way round, ...), each round a child of its own on a fresh database: a shared host's speed moves
within minutes, so the throughput ratios are the medians of the rounds with the worst round
beside them, and every overshoot bound must hold in every round.

The step's stamp is the host's clock, taken a moment after the backend counted the start on its
own clock (the database's, or Redis's `TIME`); on a loaded machine that moment varies by tens of
ms. A sliding window counts over its period plus a margin (min(50 ms, 5 %)) and the worker
counts a start again when its call would come later than the margin after its count, so the
stamps should never show more than the limit in a trailing period (see docs/flow-control.md, "Rate
limits count step starts"). The figures are printed raw; the targets are applied to them as
they are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

from tests.reliability.evidence import max_overlap, most_in_trailing  # noqa: E402 - after sys.path

PG_SERVER = "postgres://postgres@127.0.0.1:5432"
PYTHON = sys.executable
STACKS = {"db-sqlite": ("db", "db", False), "db-postgres": ("db", "db", True), "rq-redis": ("redis", "rq", True)}
RATE_LIMIT, PERIOD_MS = 20, 1000
SCENARIOS = ("parked", "cap", "sliding", "fixed")
#: How long after the backend counts a start the step may stamp it, at most, on a loaded host:
#: the informational "950 ms" rows allow for it.
STAMP_SLACK_MS = 50
#: The goals of a paced figure (the cap's steps/s, the sliding window's starts/s) against its
#: theory: the median of the rounds at least GOAL_MEDIAN of it, the worst round at least GOAL_WORST.
GOAL_MEDIAN, GOAL_WORST = 0.95, 0.9


# -- parent: one child process per stack ----------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller counts (CI smoke)")
    parser.add_argument("--stacks", default=",".join(STACKS), help=f"comma-separated, of {', '.join(STACKS)}")
    parser.add_argument("--verbose", action="store_true", help="also print starts per aligned second")
    parser.add_argument(
        "--rounds", type=int, default=None, help="alternating rounds of every stack (default 3; --quick 2)"
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14"))
    parser.add_argument("--child", choices=list(STACKS), help=argparse.SUPPRESS)
    reporting.add_json_option(parser, "contention")
    return parser.parse_args()


def pg_admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(sql)


def run_stack(
    stack: str, args: argparse.Namespace, script: str = __file__, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Run one stack's child (`script --child`, e.g. bench/caps.py's) on throwaway storage; its
    figures, or {"error": ...}."""
    admission, transport, postgres = STACKS[stack]
    tag = uuid.uuid4().hex[:8]
    test_id = f"bench-contention-{tag}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "settings.test",
        "DJANGO_DEBUG": "0",  # as deployed: DEBUG logs every query's SQL (bench/fleet.py)
        "DURABLE_FLOW_TEST_ID": test_id,
        "DURABLE_FLOW_ADMISSION": admission,
        "DURABLE_FLOW_TRANSPORT": transport,
        "DURABLE_FLOW_LOG": "WARNING",
        "REDIS_URL": args.redis_url,
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("DURABLE_FLOW_SUBPROCESS", None)
    env.pop("DURABLE_FLOW_TEST_MARKER", None)
    database = f"durable_flow_bench_contention_{tag}"
    if postgres:
        pg_admin(f"CREATE DATABASE {database}")
        env["DATABASE_URL"] = f"{PG_SERVER}/{database}"
    else:
        env.pop("DATABASE_URL", None)
    command = [PYTHON, script, "--child", stack, "--redis-url", args.redis_url, *extra]
    if args.quick:
        command.append("--quick")
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 900 s"}
    finally:
        if postgres:
            pg_admin(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        else:
            for suffix in ("", "-wal", "-shm"):
                (ROOT / "var" / f"test-{test_id}.sqlite3{suffix}").unlink(missing_ok=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"child exited {proc.returncode}: {lines[-1] if lines else 'no output'}"}
    return json.loads(lines[-1])


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


#: The throughput figures held to a goal: (scenario, label, key, theory). Their targets: the
#: median of the rounds' ratios >= GOAL_MEDIAN, the worst round's >= GOAL_WORST.
PACED = (
    ("cap", "cap 2, 50 ms: steps/s ({runs} runs, 4 keys)", "steps_s", 40.0),
    ("sliding", "sliding 20/1 s: starts/s ({runs} runs)", "starts_s", float(RATE_LIMIT)),
)
#: The overshoot bounds, which must hold in every round (the most over the rounds is shown):
#: (scenario, label, key, bound).
EXACT = (
    ("cap", "most steps running at once", "overlap", 2),
    ("cap", "turns per run, max", "turns_max", 3),
    ("sliding", "most starts in any trailing 1,000 ms", "most", RATE_LIMIT),
    ("sliding", "turns per run, max", "turns_max", 3),
    ("fixed", "most starts in one aligned window", "most", RATE_LIMIT),
    ("fixed", "turns per run, max", "turns_max", 3),
)
#: Shown beside them, no target: (scenario, label, key, theory or 0 for none). Medians of the rounds.
SHOWN = (
    ("cap", "(ceiling 2 / measured step time)", "steps_s", "ceiling_s"),
    ("cap", "turns per run, mean", "turns_mean", 3),
    ("cap", "handoff gap (end -> next start), median ms", ("gap_ms", 0), 0),
    ("cap", "handoff gap, p90 ms", ("gap_ms", 1), 0),
    ("sliding", "steady: from the first window's last start", "steady_s", float(RATE_LIMIT)),
    ("sliding", "(most starts in any trailing 950 ms)", "most_950", RATE_LIMIT),
    ("fixed", "fixed 20/1 s: starts/s ({runs} runs)", "starts_s", float(RATE_LIMIT)),
    ("fixed", "(most in an aligned window, its last 950 ms)", "most_950", RATE_LIMIT),
)


def pick(figures: dict[str, Any], key: str | tuple[str, int]) -> float:
    return figures[key[0]][key[1]] if isinstance(key, tuple) else figures[key]


def folded(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A stack's rounds folded: per paced figure the rounds' ratios, their median and worst; per
    overshoot bound the most over the rounds."""
    done = [res for res in rounds if "error" not in res]
    out: dict[str, Any] = {"rounds": rounds, "failed_rounds": len(rounds) - len(done)}
    for name, _, key, theory in PACED:
        ratios = [res[name][key] / theory for res in done if name in res]
        if ratios:
            out[f"{name}_ratio"] = {"median": statistics.median(ratios), "worst": min(ratios), "rounds": ratios}
    for name, _, key, _ in EXACT:
        values = [res[name][key] for res in done if name in res]
        if values:
            out[f"{name}_{key}_max"] = max(values)
    return out


def show(
    stack: str, label: str, measured: float, theory: float, ratio: str = "", worst: str = "", target: str = ""
) -> None:
    """One row of the table."""
    value = f"{measured:>9.1f}" if isinstance(measured, float) else f"{measured:>9}"
    print(f"{stack:<12} {label:<50} {value} {theory:>7.4g} {ratio:>6} {worst:>6}  {target}".rstrip())


def report(
    results: dict[str, list[dict[str, Any]]], quick: bool, verbose: bool
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Print the tables; return every target with its verdict, and each stack's folded figures."""
    targets: list[dict[str, Any]] = []
    stacks: dict[str, dict[str, Any]] = {}
    rounds = max((len(each) for each in results.values()), default=0)
    print(
        f"\nFlow control under contention ({os.cpu_count()} CPUs; {'--quick' if quick else 'full'} counts; "
        f"{rounds} alternating round(s): medians, worst round beside them, bounds over every round)"
    )
    header = f"{'stack':<12} {'figure':<50} {'measured':>9} {'theory':>7} {'ratio':>6} {'worst':>6}  target"
    print(header + "\n" + "-" * (len(header) + 16))
    for stack, each in results.items():
        stacks[stack] = fold = folded(each)
        for number, res in enumerate(each, 1):
            if "error" in res:
                print(f"{stack:<12} round {number} FAILED: {res['error']}")
        targets.append(reporting.target(f"{stack}: rounds that failed", fold["failed_rounds"], "==", 0))
        done = [res for res in each if "error" not in res]
        if not done:
            continue

        for name in ("cap", "sliding", "fixed"):
            runs = [res[name] for res in done if name in res]
            if not runs:
                continue
            for scenario_name, label, key, theory in PACED:
                if scenario_name != name:
                    continue
                ratio = fold[f"{name}_ratio"]
                label = label.format(runs=runs[0]["runs"])
                measured = statistics.median(figures[key] for figures in runs)
                middle = reporting.target(
                    f"{stack} {label}: ratio, median of the rounds", ratio["median"], ">=", GOAL_MEDIAN
                )
                worst = reporting.target(f"{stack} {label}: ratio, worst round", ratio["worst"], ">=", GOAL_WORST)
                targets += [middle, worst]
                marks = f">= {GOAL_MEDIAN:g} {verdict(middle['met'])}, worst >= {GOAL_WORST:g} {verdict(worst['met'])}"
                show(stack, label, measured, theory, f"{ratio['median']:.2f}", f"{ratio['worst']:.2f}", marks)
            for scenario_name, label, key, theory in SHOWN:
                if scenario_name != name:
                    continue
                measured = statistics.median(pick(figures, key) for figures in runs)
                bound = statistics.median(figures[theory] for figures in runs) if isinstance(theory, str) else theory
                label = "  " + label.format(runs=runs[0]["runs"])
                ratio = f"{measured / bound:.2f}" if bound else ""
                show(stack, label, measured, bound, ratio)
            for scenario_name, label, key, bound in EXACT:
                if scenario_name != name:
                    continue
                most = fold[f"{name}_{key}_max"]
                entry = reporting.target(f"{stack} {name}: {label}, every round", most, "<=", bound)
                targets.append(entry)
                show(stack, f"  {label}, every round", most, bound, target=f"<= {bound} {verdict(entry['met'])}")
            if verbose and name in ("sliding", "fixed"):
                for number, figures in enumerate(runs, 1):
                    print(f"{stack:<12}   {name} round {number} starts per aligned second: {figures['per_window']}")
        print()
    parked = [
        (backend, row)
        for each in results.values()
        for res in each[:1]
        for backend, row in res.get("parked", {}).items()
    ]
    if not parked:
        return targets, stacks
    few, many = parked[0][1]["waiters"]
    print(
        f"Parked waiters (first round): median µs per operation with {few:,} vs {many:,} waiters (target ratio <= 1.5)"
    )
    header = f"{'backend':<26} {'operation':<30} {few:>9,} {many:>9,} {'ratio':>6}"
    print(header + "\n" + "-" * (len(header) + 6))
    for backend, row in parked:
        for label, key in (
            ("decision (try_admit, parks)", "decision"),
            ("release + grant", "release_grant"),
            ("poller tick + grant_queues", "tick"),
        ):
            small, large = row[key]
            ratio = large / small
            targets.append(reporting.target(f"{backend} {label}: {many:,} / {few:,} waiters", ratio, "<=", 1.5))
            print(f"{backend:<26} {label:<30} {small:>9.0f} {large:>9.0f} {ratio:>6.2f}  {verdict(ratio <= 1.5)}")
    fills = ", ".join(f"{backend} {row['fill_s']:.1f} s" for backend, row in parked)
    print(f"\n(fill of the large line, runs and checkpoints bulk-inserted: {fills})")
    return targets, stacks


def main() -> None:
    args = parse_args()
    if args.child:
        child(args.child, args.quick, args.redis_url, set(args.scenarios.split(",")))
        return
    stacks = [name.strip() for name in args.stacks.split(",") if name.strip()]
    unknown = [name for name in stacks if name not in STACKS]
    if unknown:
        raise SystemExit(f"unknown stack(s): {', '.join(unknown)}; choose from {', '.join(STACKS)}")
    if any(STACKS[name][1] == "rq" for name in stacks):
        from services import require_own_redis_database

        require_own_redis_database(args.redis_url)  # it clears `rq:*` and its workers pop `durable`
    rounds = args.rounds or (2 if args.quick else 3)
    if rounds < 1:
        raise SystemExit("--rounds: at least 1")
    scenarios = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    started = time.monotonic()
    results: dict[str, list[dict[str, Any]]] = {stack: [] for stack in stacks}
    for round_ in range(rounds):
        # The parked waiters once (a ratio within one child); the paced scenarios every round.
        these = [name for name in scenarios if round_ == 0 or name != "parked"]
        if not these:
            break
        for stack in stacks if round_ % 2 == 0 else stacks[::-1]:
            reporting.log(f"[{time.monotonic() - started:5.0f} s] round {round_ + 1} of {rounds}: {stack} ...")
            results[stack].append(run_stack(stack, args, extra=("--scenarios", ",".join(these))))
    targets, folded_stacks = report(results, args.quick, args.verbose)
    print(f"total {time.monotonic() - started:.0f} s")
    summary = [
        f"{stack}: cap {fold['cap_ratio']['median']:.2f} of ideal (worst round {fold['cap_ratio']['worst']:.2f}), "
        f"sliding {fold['sliding_ratio']['median']:.2f} of its limit (worst {fold['sliding_ratio']['worst']:.2f})"
        for stack, fold in folded_stacks.items()
        if "cap_ratio" in fold and "sliding_ratio" in fold
    ]
    summary += [
        f"{stack}: {fold['failed_rounds']} round(s) FAILED"
        for stack, fold in folded_stacks.items()
        if fold["failed_rounds"]
    ]
    reporting.write_json(
        "contention",
        {
            "quick": args.quick,
            "rounds": rounds,
            "goal_median": GOAL_MEDIAN,
            "goal_worst": GOAL_WORST,
            "stacks": folded_stacks,
        },
        path=args.json,
        summary=summary,
        targets=targets,
    )


# -- child: one stack ---------------------------------------------------------------------------
def log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def setup_django() -> None:
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def clear_rq() -> None:
    import django_rq

    connection = django_rq.get_connection("durable")
    keys = list(connection.scan_iter("rq:*", count=1000))
    if keys:
        connection.delete(*keys)


def clear_prefix(prefix: str) -> None:
    import django_rq

    connection = django_rq.get_connection("default")
    keys = list(connection.scan_iter(f"{prefix}:*", count=1000))
    if keys:
        connection.delete(*keys)


def child(stack: str, quick: bool, redis_url: str, scenarios: set[str]) -> None:
    setup_django()
    admission, transport, _ = STACKS[stack]
    runs = 60 if quick else 200
    waiters = (100, 2_000) if quick else (100, 10_000)
    out: dict[str, Any] = {}
    # settings.test's key prefix for the redis backend the workers use (the test id is unique).
    prefix = f"df:test:{os.environ['DURABLE_FLOW_TEST_ID']}" if admission == "redis" else ""
    workdir = Path(tempfile.mkdtemp(prefix="bench-contention-"))
    try:
        if transport == "rq":
            clear_rq()
        if "parked" in scenarios:
            log("parked waiters")
            out["parked"] = parked_figures(stack, waiters, redis_url, samples=60 if quick else 150)
        if "cap" in scenarios:
            log("cap 2, 50 ms steps")
            out["cap"] = scenario(workdir, "cap", runs, concurrency=2, seconds=0.05, keys=4)
        if "sliding" in scenarios:
            log("sliding 20 per 1,000 ms")
            out["sliding"] = scenario(workdir, "sliding", runs, rate="sliding", seconds=0.01)
        if "fixed" in scenarios:
            log("fixed 20 per 1,000 ms")
            out["fixed"] = scenario(workdir, "fixed", runs, rate="fixed", seconds=0.01)
    finally:
        if transport == "rq":
            clear_rq()
        if prefix:
            clear_prefix(prefix)
        from django.db import connections

        connections.close_all()
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(out))


class Processes:
    """The stack's worker and poller processes, logging to files, always reaped."""

    def __init__(self, workdir: Path, marker: Path, workers: int = 2) -> None:
        env = {**os.environ, "DURABLE_FLOW_TEST_MARKER": str(marker)}
        commands = [["durable_worker", "--concurrency", "4"]] * workers + [["durable_poller"]]
        self.logs = [workdir / f"{marker.stem}-{i}-{cmd[0]}.log" for i, cmd in enumerate(commands)]
        self.procs = [
            subprocess.Popen(
                [PYTHON, str(ROOT / "manage.py"), *cmd],
                cwd=ROOT,
                env=env,
                stdout=open(path, "wb"),  # closed in stop()
                stderr=subprocess.STDOUT,
            )
            for cmd, path in zip(commands, self.logs, strict=True)
        ]

    def wait_until_up(self, timeout_s: float = 120.0) -> None:
        """Until every worker has written its first heartbeat (it is claiming)."""
        from durable_flow.models import WorkerHeartbeat

        pids = {proc.pid for proc in self.procs[:-1]}
        deadline = time.monotonic() + timeout_s
        while WorkerHeartbeat.objects.filter(pid__in=pids, stopped_at__isnull=True).count() < len(pids):
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not up after {timeout_s:.0f} s")
            time.sleep(0.1)

    def check(self) -> None:
        for proc, path in zip(self.procs, self.logs, strict=True):
            if proc.poll() is not None:
                tail = path.read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"{path.name} exited {proc.returncode}: " + " | ".join(tail))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()


def read_stamps(marker: Path, prefix: str) -> tuple[list[float], list[tuple[float, float]]]:
    """Start stamps (sorted) and (start, end) intervals of the `tests.slow` calls whose id has `prefix`."""
    opened: dict[tuple[str, str], float] = {}
    starts: list[float] = []
    intervals: list[tuple[float, float]] = []
    for line in marker.read_text().splitlines():
        name, value, pid, at = line.split()
        if not value.startswith(prefix):
            continue
        if name == "slow_start":
            opened[(value, pid)] = float(at)
            starts.append(float(at))
        elif name == "slow_end":
            intervals.append((opened.pop((value, pid)), float(at)))
    return sorted(starts), intervals


def scenario(
    workdir: Path,
    name: str,
    runs: int,
    *,
    seconds: float,
    concurrency: int | None = None,
    rate: str | None = None,
    keys: int = 0,
) -> dict[str, Any]:
    """Create `runs` runs through a fresh queue, run them with real processes, read the stamps."""
    from django.db import transaction

    from durable_flow import register_queue, start
    from durable_flow.models import RunStatus, WorkflowRun

    queue = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    rate_limit = {"limit": RATE_LIMIT, "period_ms": PERIOD_MS, "algorithm": rate} if rate else None
    register_queue(queue, concurrency=concurrency, rate_limit=rate_limit, fairness="key" if keys else "fifo")
    prefix = f"{name}-"
    marker = workdir / f"{name}.marker"
    marker.touch()
    # Workers up before the clock (as in bench/peer_dbos.py): the figures are the limiter's and
    # the handoff's, not the processes' start-up.
    procs = Processes(workdir, marker)
    ids: list[str] = []
    try:
        procs.wait_until_up()
        with transaction.atomic():  # the whole backlog at once: contention from the first instant
            for i in range(runs):
                payload: dict[str, Any] = {"queue": queue, "seconds": seconds, "id": f"{prefix}{i}"}
                if keys:
                    payload["key"] = f"tenant-{i % keys}"
                ids.append(start("tests.queued", payload).id)
    except BaseException:
        procs.stop()
        raise
    done = WorkflowRun.objects.filter(pk__in=ids, status=RunStatus.COMPLETED)
    shown = reporting.Progress(f"  {name}", total=runs, unit="runs completed")
    try:
        deadline = time.monotonic() + 300
        while (completed := done.count()) < runs:
            shown.update(completed)
            procs.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: {done.count()} of {runs} runs completed in 300 s")
            time.sleep(0.2)
    finally:
        procs.stop()
    starts, intervals = read_stamps(marker, prefix)
    turns = list(WorkflowRun.objects.filter(pk__in=ids).values_list("turns", flat=True))
    out: dict[str, Any] = {
        "runs": runs,
        "turns_max": max(turns),
        "turns_mean": statistics.mean(turns),
        "executions": len(starts),
    }
    if concurrency:
        low, high = len(starts) // 10, len(starts) - 1 - len(starts) // 10
        out["steps_s"] = (high - low) / (starts[high] - starts[low])
        out["ceiling_s"] = concurrency / statistics.mean(end - begin for begin, end in intervals)
        out["overlap"] = max_overlap(intervals)
        # The handoff: a step ends, its result is recorded, the release grants the slot to the
        # next waiter, that step is dispatched, claimed and called. With 2 slots, start i can
        # only follow the (i-2)-th end; the gap is what one handoff costs.
        ends = sorted(end for _, end in intervals)
        gaps = sorted(starts[i] - ends[i - concurrency] for i in range(concurrency, len(starts)))
        out["gap_ms"] = [gaps[len(gaps) // 2] * 1000, gaps[int(len(gaps) * 0.9)] * 1000]
    elif rate == "sliding":
        out["starts_s"] = (len(starts) - RATE_LIMIT) / (starts[-1] - starts[0])
        # The limiter's own pace: how fast places that age out are filled again, from the last of
        # the first window's starts on (the first window's spread is the fleet warming up: 8
        # threads claiming their first tasks; every later window repeats its shape).
        out["steady_s"] = (len(starts) - RATE_LIMIT) / (starts[-1] - starts[RATE_LIMIT - 1])
        out["most"] = most_in_trailing(starts, PERIOD_MS / 1000)
        out["most_950"] = most_in_trailing(starts, (PERIOD_MS - STAMP_SLACK_MS) / 1000)
    else:
        per_window = Counter(int(at * 1000) // PERIOD_MS for at in starts)
        first, last = min(per_window), max(per_window)
        # After the first (partial) window, N - n_first starts fill whole windows up to the last.
        out["starts_s"] = (len(starts) - per_window[first]) / ((last - first) * PERIOD_MS / 1000)
        out["most"] = max(per_window.values())
        late = Counter(int(at * 1000) // PERIOD_MS for at in starts if int(at * 1000) % PERIOD_MS >= STAMP_SLACK_MS)
        out["most_950"] = max(late.values())
    if rate:
        windows = Counter(int(at * 1000) // PERIOD_MS for at in starts)
        out["per_window"] = [windows.get(i, 0) for i in range(min(windows), max(windows) + 1)]
    return out


# -- parked waiters: operation cost with 100 vs 10,000 waiters ---------------------------------------
HOLDERS = 5


def parked_figures(stack: str, waiters: tuple[int, int], redis_url: str, samples: int) -> dict[str, Any]:
    from django.db import connection

    from durable_flow.admission.db.backend import DatabaseAdmissionBackend
    from durable_flow.admission.local import LocalAdmissionBackend
    from durable_flow.admission.redis.backend import RedisAdmissionBackend

    vendor = "SQLite" if connection.vendor == "sqlite" else "PostgreSQL"
    makers: dict[str, Callable[[], Any]] = {}
    if stack == "db-sqlite":
        makers["local"] = LocalAdmissionBackend
    if stack in ("db-sqlite", "db-postgres"):
        makers[f"db ({vendor})"] = DatabaseAdmissionBackend
    if stack == "rq-redis":
        makers[f"redis (tick: {vendor})"] = lambda: RedisAdmissionBackend(
            url=redis_url, key_prefix=f"bench:contention:{uuid.uuid4().hex[:12]}"
        )
    small, large = waiters
    out: dict[str, Any] = {}
    for label, make in makers.items():
        # small, large, small: the two small blocks bracket the large one, so load that drifts
        # over the minute (the machine is shared) weighs on both sides of the ratio alike.
        before = parked_case(make(), small, samples // 2)
        many = parked_case(make(), large, samples)
        after = parked_case(make(), small, samples - samples // 2)
        row: dict[str, Any] = {"waiters": [small, large], "fill_s": many.pop("fill_s")}
        for key, latencies in many.items():
            row[key] = [statistics.median(before[key] + after[key]) * 1e6, statistics.median(latencies) * 1e6]
        out[label] = row
    return out


def fill_waiters(backend: Any, queue: str, tickets: list[str]) -> None:
    """Put the parked calls in the backend's line: bulk rows on `db` (10,000 decisions one by
    one would dominate the bench), decisions elsewhere."""
    from durable_flow.admission.base import AdmissionRequest
    from durable_flow.admission.db.backend import DatabaseAdmissionBackend
    from durable_flow.models import AdmissionWaiter, FlowQueue

    if isinstance(backend, DatabaseAdmissionBackend):
        now = int(backend.clock())
        AdmissionWaiter.objects.bulk_create(
            (
                AdmissionWaiter(queue=queue, ticket=t, fairness_key=t.rpartition("/")[0], arrival=i, seen_ms=now)
                for i, t in enumerate(tickets)
            ),
            batch_size=2000,
        )
        FlowQueue.objects.filter(name=queue).update(next_arrival=len(tickets))
        return
    for ticket in tickets:
        assert not backend.try_admit(AdmissionRequest(queue, ticket)).admitted


def timed(samples: int, body: Callable[[int], None], between: Callable[[int], None] | None = None) -> list[float]:
    """Seconds of each of `samples` calls of `body(i)` after 10 warm-up calls; `between` runs untimed."""
    latencies = []
    for i in range(samples + 10):
        began = time.perf_counter()
        body(i)
        elapsed = time.perf_counter() - began
        if i >= 10:
            latencies.append(elapsed)
        if between is not None:
            between(i)
    return latencies


def parked_case(backend: Any, count: int, samples: int) -> dict[str, Any]:
    """One queue, every slot held, `count` parked runs waiting: time the three operations."""
    from django.db import connection

    from durable_flow.admission.base import AdmissionRequest
    from durable_flow.config.queues import QueueConfig
    from durable_flow.config.settings import get_settings
    from durable_flow.engine import Engine
    from durable_flow.models import (
        AdmissionKeyServed,
        AdmissionMark,
        AdmissionSlot,
        AdmissionStart,
        AdmissionWaiter,
        FlowQueue,
        RunStatus,
        StepCheckpoint,
        StepStatus,
        WorkflowRun,
    )
    from durable_flow.runtime.poller import TimerPoller
    from durable_flow.transports.db.transport import DatabaseTransport

    tag = uuid.uuid4().hex[:6]
    queue = f"bench-parked-{tag}"
    engine = Engine(admission=backend, transport=DatabaseTransport(), settings=get_settings())
    engine.register_queue(QueueConfig(name=queue, concurrency=HOLDERS))
    for i in range(HOLDERS):
        assert backend.try_admit(AdmissionRequest(queue, f"h{i}-{tag}/1")).admitted
    run_ids = [f"parked-{tag}-{i:05d}" for i in range(count)]
    began = time.perf_counter()
    WorkflowRun.objects.bulk_create(
        (WorkflowRun(id=r, workflow="tests.queued", status=RunStatus.SUSPENDED, turns=1) for r in run_ids),
        batch_size=2000,
    )
    StepCheckpoint.objects.bulk_create(
        (
            StepCheckpoint(run_id=r, key="1", sequence=1, name="tests.echo", status=StepStatus.WAITING, queue=queue)
            for r in run_ids
        ),
        batch_size=2000,
    )
    fill_waiters(backend, queue, [f"{r}/1" for r in run_ids])
    fill_s = time.perf_counter() - began
    if connection.vendor == "postgresql":  # standing in for autovacuum, as bench/poller.py does
        with connection.cursor() as cursor:
            for model in (WorkflowRun, StepCheckpoint, AdmissionWaiter):
                cursor.execute(f"ANALYZE {model._meta.db_table}")
    poller = TimerPoller(engine=engine)

    def decide(i: int) -> None:
        assert backend.try_admit(AdmissionRequest(queue, f"new-{tag}-{i}/1")).reason == "concurrency"

    def withdraw(i: int) -> None:  # keep the line at `count` waiters
        backend.release(queue, f"new-{tag}-{i}/1", grant_next=False)

    holders = deque(f"h{i}-{tag}/1" for i in range(HOLDERS))

    def release_grant(_: int) -> None:
        granted = backend.release(queue, holders.popleft()).tickets
        assert len(granted) == 1, granted
        holders.extend(granted)

    def refill(i: int) -> None:  # the granted waiter left the line: one joins at its end
        assert not backend.try_admit(AdmissionRequest(queue, f"refill-{tag}-{i}/1")).admitted

    def tick(_: int) -> None:
        assert poller.tick() == []
        assert poller.grant_queues() == 0

    try:
        return {
            "decision": timed(samples, decide, withdraw),
            "release_grant": timed(samples, release_grant, refill),
            "tick": timed(samples, tick),
            "fill_s": fill_s,
        }
    finally:
        WorkflowRun.objects.filter(id__startswith=f"parked-{tag}-").delete()
        for model in (AdmissionSlot, AdmissionWaiter, AdmissionMark, AdmissionStart, AdmissionKeyServed):
            model.objects.filter(queue=queue).delete()
        FlowQueue.objects.filter(name=queue).delete()
        close = getattr(backend, "close", None)
        if close is not None:
            if hasattr(backend, "prefix"):
                clear_prefix_on(backend)
            close()


def clear_prefix_on(backend: Any) -> None:
    keys = list(backend.redis.scan_iter(f"{backend.prefix}:*", count=1000))
    if keys:
        backend.redis.delete(*keys)


if __name__ == "__main__":
    main()
