#!/usr/bin/env python
"""Transport throughput: raw RQ vs durable_flow over RQ vs durable_flow over the db transport.

    .venv/bin/python bench/transport.py            # ~4 minutes
    .venv/bin/python bench/transport.py --quick    # ~2 minutes

For 1, 2 and 4 worker processes:

* raw RQ: N no-op jobs (`os.getpid`) are enqueued, then P `rq worker -w rq.worker.SimpleWorker`
  processes (non-forking) drain them; jobs finished per second.
* durable_flow/rq: N one-step workflows (`tests.slow_one` with a 0 s sleep: a turn, the step,
  the final turn) are started, then P `durable_worker` processes (`--concurrency C`) run them
  until all complete; workflows completed per second, and their ratio to raw RQ. The defaults:
  a turn's step runs on the turn's thread (`EAGER_STEPS`): one job per workflow; a run's first
  plain step runs before anything is written and is recorded with its result
  (`OPTIMISTIC_FIRST_STEP`, `engine/optimistic.py`).
* durable_flow/rq-locked: the same with `OPTIMISTIC_FIRST_STEP` off: the turn writes the step
  as running before it runs, then the result is recorded: one transaction more.
* durable_flow/rq-jobs: the same with `EAGER_STEPS` off, every step an RQ job: two jobs.
* durable_flow/db: the same on the `db` transport.

Raw RQ and durable_flow/rq (the defaults) are measured `--rounds` times at each process count,
alternately (raw, rq, raw, rq, ...), and the table gives the medians, with the ratio the median
of each round's ratio to the raw RQ run just before it: on a shared host whose speed moves
within minutes, one pair of runs measures the host as much as the code, and a pair run back to
back sees the same host. Each round's figures are printed under the table, the worst ratio with
them. The other columns (`rq-locked`, `rq-jobs`, `db`) run once, against the median raw RQ rate.
The targets (`GOALS`): over rq, the median of the rounds at least 1.0 / 0.8 / 0.7 of raw RQ at
1 / 2 / 4 processes (a count with no goal is printed without one).

Throughput is measured from the first work done (a finished job; a run's first turn) to the
90 % completion mark, so process start-up (Django import, Redis/DB connections) and the tail
do not count, for every contender alike. (Not from the 10 % completion mark: over `rq` with
`EAGER_STEPS` off a workflow is two jobs, and the backlog drains FIFO, every run's turn and
then every run's step, so the first run completes only once every turn has run.)
Everything runs on its own PostgreSQL database (created and dropped here) and the Redis
database of `--redis-url` (its `rq:*` keys are cleared; default db 14), which no other process may
use meanwhile: the bench refuses one another client is connected to (`services.require_own_redis_database`).

A one-step workflow costs one RQ job (the turn, its step run next on the same thread, the final
turn in the result's transaction; two with `EAGER_STEPS` off) and about ten SQL statements in
three transactions, against one job and no SQL for raw RQ: the ratio is per *workflow*. The CPU
lines say why it falls with more processes: on a machine with few cores the processes share them,
and a rate is bounded by the cores over the CPU milliseconds one item costs all processes together
(the workers, PostgreSQL, Redis).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from subprocess import STDOUT

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it
from services import pg_admin, require_own_redis_database, stop, worker_output  # noqa: E402 - bench/ is on the path of a script run from it

PG_SERVER = "postgres://postgres@127.0.0.1:5432"
PG_DATABASE = f"durable_flow_bench_transport_{os.getpid()}"  # its own: other sessions may run this bench too
PYTHON = str(ROOT / ".venv" / "bin" / "python")
RQ_CLI = str(ROOT / ".venv" / "bin" / "rq")
RQ_WORKER = [RQ_CLI, "worker", "-w", "rq.worker.SimpleWorker", "--logging_level", "WARNING"]
#: Over rq (the defaults) / raw RQ, the median of the rounds, at least this at each process count.
GOALS = {1: 1.0, 2: 0.8, 4: 0.7}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer jobs and runs")
    parser.add_argument("--processes", default="1,2,4", help="worker process counts")
    parser.add_argument("--concurrency", type=int, default=8, help="durable_worker threads per process")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating raw RQ / rq runs per process count (the medians)"
    )
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14"))
    reporting.add_json_option(parser, "transport")
    return parser.parse_args()


def setup_django(redis_url: str) -> None:
    os.environ.update(
        {
            "DURABLE_FLOW_TEST_ID": "bench-transport",
            "DJANGO_SETTINGS_MODULE": "settings.test",
            "DATABASE_URL": f"{PG_SERVER}/{PG_DATABASE}",
            "REDIS_URL": redis_url,
            "DURABLE_FLOW_LOG": "WARNING",
            "DJANGO_DEBUG": "0",  # as deployed: DEBUG keeps every query's SQL in memory
        }
    )
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    pg_admin(f"DROP DATABASE IF EXISTS {PG_DATABASE}")
    pg_admin(f"CREATE DATABASE {PG_DATABASE}")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def steady_rate(
    count: Callable[[], int],
    total: int,
    procs: list[subprocess.Popen[bytes]],
    timeout: float,
    begun: Callable[[], bool] | None = None,
    cpu: dict[str, float] | None = None,
) -> float:
    """Items per second between the 10 % and 90 % completion marks; with `begun`, from the
    first moment `begun()` is true (the first work done) to the 90 % mark instead.

    `begun` is for work whose completions all come at the end: the runs of a two-job workflow
    drain FIFO (every run's turn job, then every run's step job), so the 10 % mark falls in the
    step phase and a window on completions alone would time the step jobs only.

    With `cpu`, it is filled with the CPU milliseconds per item spent over the same window by
    the worker processes, the PostgreSQL server and the Redis server (`cpu_seconds`)."""
    low, high = max(1, total // 10), total - total // 10
    shown = reporting.Progress("workers running the backlog", total=total, unit="done")
    t_low = t_high = None
    done_at_low = low
    cpu_at_low: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = count()
        shown.update(done)
        now = time.monotonic()
        if t_low is None and (begun() if begun is not None else done >= low):
            t_low, done_at_low = now, done
            cpu_at_low = cpu_seconds(procs) if cpu is not None else {}
        if done >= high and t_low is not None:
            t_high = now
            break
        if any(proc.poll() not in (None, 0) for proc in procs):
            raise RuntimeError("a worker process died")
        time.sleep(0.01)
    if t_low is None or t_high is None:
        raise RuntimeError(f"timed out: {count()} of {total} done")
    if cpu is not None:
        items = max(1, high - done_at_low)
        cpu.update({kind: 1000 * (spent - cpu_at_low[kind]) / items for kind, spent in cpu_seconds(procs).items()})
    return (high - done_at_low) / max(1e-6, t_high - t_low)


def cpu_seconds(procs: list[subprocess.Popen[bytes]]) -> dict[str, float]:
    """CPU time (user + system) so far of the worker processes, of every PostgreSQL server
    process (the bench's own polling backend included: a few percent) and of Redis."""
    import psutil

    spent = {"workers": 0.0, "postgres": 0.0, "redis": 0.0}
    workers = {proc.pid for proc in procs}
    for process in psutil.process_iter(["name"]):
        name = process.info["name"] or ""
        if process.pid in workers:
            kind = "workers"
        elif name.startswith("postgres"):
            kind = "postgres"
        elif name.startswith("redis-server"):
            kind = "redis"
        else:
            continue
        try:
            times = process.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        spent[kind] += times.user + times.system
    return spent


def clear_redis() -> None:
    import django_rq

    connection = django_rq.get_connection("durable")
    keys = list(connection.scan_iter("rq:*", count=1000))
    if keys:
        connection.delete(*keys)


def raw_rq(jobs: int, processes: int, redis_url: str, cpu: dict[str, float] | None = None) -> float:
    import django_rq
    from rq import Queue, Worker
    from rq.registry import FinishedJobRegistry

    clear_redis()
    queue = Queue("bench-raw", connection=django_rq.get_connection("durable"))
    procs = [
        subprocess.Popen(
            [*RQ_WORKER, "-u", redis_url, "bench-raw"], cwd=ROOT, stdout=worker_output("rq_worker"), stderr=STDOUT
        )
        for _ in range(processes)
    ]
    try:
        wait_until(lambda: Worker.count(queue=queue) >= processes, procs, "raw RQ workers up")
        batch = 500
        for offset in range(0, jobs, batch):
            datas = [Queue.prepare_data("os.getpid", result_ttl=600) for _ in range(min(batch, jobs - offset))]
            queue.enqueue_many(datas)
        registry = FinishedJobRegistry(queue=queue)
        return steady_rate(lambda: registry.count, jobs, procs, 300, begun=lambda: registry.count > 0, cpu=cpu)
    finally:
        stop(procs)


def wait_until(ready: Callable[[], bool], procs: list[subprocess.Popen[bytes]], what: str) -> None:
    """Wait for the workers to be up (started, connected, registered) before the backlog exists,
    so no contender's start-up (Django's import costs about a second of CPU a process) falls in
    the timed window."""
    deadline = time.monotonic() + 120
    while not ready():
        if any(proc.poll() is not None for proc in procs):
            raise RuntimeError(f"a worker process exited before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def durable(
    transport: str,
    runs: int,
    processes: int,
    concurrency: int,
    *,
    eager_steps: bool = True,
    optimistic: bool = True,
    cpu: dict[str, float] | None = None,
) -> float:
    from django.db import connection, transaction

    from durable_flow.admission.local import LocalAdmissionBackend
    from durable_flow.config.settings import get_settings
    from durable_flow.engine import Engine, set_engine
    from durable_flow.models import RunStatus, Task, WorkerHeartbeat, WorkflowRun
    from durable_flow.transports.db.transport import DatabaseTransport
    from durable_flow.transports.rq import RQTransport

    clear_redis()
    with connection.cursor() as cursor:
        for model in (Task, WorkerHeartbeat, WorkflowRun):
            cursor.execute(f"TRUNCATE {model._meta.db_table} CASCADE")
    backend = RQTransport(queue="durable") if transport == "rq" else DatabaseTransport()
    engine = Engine(admission=LocalAdmissionBackend(), transport=backend, settings=get_settings())
    set_engine(engine)
    env = {**os.environ, "DURABLE_FLOW_TRANSPORT": transport, "PYTHONUNBUFFERED": "1"}
    if not eager_steps:
        env["DURABLE_FLOW_EAGER_STEPS"] = "0"  # settings/test.py: every step an RQ job
    if not optimistic:
        env["DURABLE_FLOW_OPTIMISTIC_FIRST_STEP"] = "0"  # settings/test.py: the locked path
    command = [PYTHON, str(ROOT / "manage.py"), "durable_worker", "--concurrency", str(concurrency)]
    procs = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=worker_output(f"durable_worker-{transport}"), stderr=STDOUT)
        for _ in range(processes)
    ]
    up = WorkerHeartbeat.objects.filter(stopped_at__isnull=True)
    completed = WorkflowRun.objects.filter(status=RunStatus.COMPLETED)
    turned = WorkflowRun.objects.filter(turns__gt=0)
    try:
        wait_until(lambda: up.count() >= processes, procs, "durable workers up")
        with transaction.atomic():  # the whole backlog at once: its tasks and jobs go out on commit
            for i in range(runs):
                engine.start("tests.slow_one", {"id": i, "seconds": 0})
        return steady_rate(completed.count, runs, procs, timeout=300, begun=turned.exists, cpu=cpu)
    finally:
        stop(procs)


def describe(cpu: dict[str, float]) -> str:
    """`cpu_seconds` per item, as one line's worth: the total, then each part."""
    parts = ", ".join(f"{kind} {ms:.2f}" for kind, ms in cpu.items())
    return f"{sum(cpu.values()):.2f} ({parts})"


def target_line(label: str, ratios: dict[int, float], goals: dict[int, float] | None = GOALS) -> str:
    """`<label>, by processes: 1: 1.04 (>= 1.0), 2: ...: met|MISSED`, the line run_all.py
    quotes; without `goals`, the ratios alone."""
    cells = []
    for processes, ratio in ratios.items():
        goal = goals.get(processes) if goals else None
        cells.append(f"{processes}: {ratio:.2f}" + (f" (>= {goal:.1f})" if goal is not None else ""))
    line = f"{label}, by processes: " + ", ".join(cells)
    if not goals:
        return line
    held = [ratios[p] >= goals[p] for p in ratios if p in goals]
    return f"{line}: {'met' if all(held) else 'MISSED'}" if held else f"{line}: no goal at these counts"


@dataclass
class Rounds:
    """One process count's alternating raw RQ / rq runs: rates, paired ratios, CPU per item."""

    raw: list[float] = field(default_factory=list)
    rq: list[float] = field(default_factory=list)
    raw_cpu: list[dict[str, float]] = field(default_factory=list)
    rq_cpu: list[dict[str, float]] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [over_rq / raw for raw, over_rq in zip(self.raw, self.rq, strict=True)]

    def line(self, processes: int) -> str:
        rates = " / ".join(f"{raw:.0f}:{over_rq:.0f}" for raw, over_rq in zip(self.raw, self.rq, strict=True))
        ratios = " / ".join(f"{ratio:.2f}" for ratio in self.ratios)
        worst = min(self.ratios)
        return f"rounds at {processes} process(es), raw RQ jobs/s:rq wf/s {rates}; ratios {ratios} (worst {worst:.2f})"

    def cpu_line(self, processes: int, locked_cpu: dict[str, float]) -> str:
        """The median round's CPU per item (by total), for each contender."""
        raw = sorted(self.raw_cpu, key=lambda cpu: sum(cpu.values()))[len(self.raw_cpu) // 2]
        over_rq = sorted(self.rq_cpu, key=lambda cpu: sum(cpu.values()))[len(self.rq_cpu) // 2]
        each = f"raw RQ {describe(raw)}; rq {describe(over_rq)}; rq-locked {describe(locked_cpu)}"
        return f"cpu ms per item at {processes} process(es) (median round): {each}"


def measure_rounds(args: argparse.Namespace, processes: int, jobs: int, runs: int) -> Rounds:
    """`args.rounds` alternating runs of raw RQ and durable_flow over rq with the defaults."""
    rounds = Rounds()
    for round_ in range(args.rounds):
        reporting.log(f"{processes} process(es), round {round_ + 1} of {args.rounds}: raw RQ, then over rq")
        raw_cpu: dict[str, float] = {}
        rq_cpu: dict[str, float] = {}
        rounds.raw.append(raw_rq(jobs, processes, args.redis_url, cpu=raw_cpu))
        rounds.rq.append(durable("rq", runs, processes, args.concurrency, cpu=rq_cpu))
        rounds.raw_cpu.append(raw_cpu)
        rounds.rq_cpu.append(rq_cpu)
    return rounds


def main() -> None:
    args = parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    require_own_redis_database(args.redis_url)
    setup_django(args.redis_url)
    jobs, runs = (3000, 800) if args.quick else (6000, 2000)
    print(f"raw RQ: {jobs} no-op jobs, SimpleWorker; durable_flow: {runs} one-step workflows, ", end="")
    print(f"durable_worker --concurrency {args.concurrency}; PostgreSQL; {os.cpu_count()} CPUs; ", end="")
    print(f"raw RQ and rq: medians of {args.rounds} alternating rounds")
    columns = [("raw RQ jobs/s", 14), ("rq wf/s", 8), ("ratio", 6)]
    columns += [("rq-locked", 9), ("ratio", 6), ("rq-jobs", 8), ("ratio", 6), ("db wf/s", 8), ("ratio", 6)]
    print(f"{'procs':>5} " + " ".join(f"{name:>{width}}" for name, width in columns))
    ratios: dict[int, float] = {}
    worst: dict[int, float] = {}
    locked_ratios: dict[int, float] = {}
    notes: list[str] = []
    per_processes: dict[int, dict[str, object]] = {}
    try:
        for processes in [int(p) for p in args.processes.split(",")]:
            locked_cpu: dict[str, float] = {}
            rounds = measure_rounds(args, processes, jobs, runs)
            reporting.log(f"{processes} process(es): rq-locked, rq-jobs, db")
            over_rq_locked = durable("rq", runs, processes, args.concurrency, optimistic=False, cpu=locked_cpu)
            over_rq_jobs = durable("rq", runs, processes, args.concurrency, eager_steps=False)
            over_db = durable("db", runs, processes, args.concurrency)
            raw, over_rq = median(rounds.raw), median(rounds.rq)
            ratios[processes], worst[processes] = median(rounds.ratios), min(rounds.ratios)
            locked_ratios[processes] = over_rq_locked / raw
            row = f"{processes:>5} {raw:>14.0f} {over_rq:>8.0f} {ratios[processes]:>6.2f}"
            row += f" {over_rq_locked:>9.0f} {over_rq_locked / raw:>6.2f}"
            row += f" {over_rq_jobs:>8.0f} {over_rq_jobs / raw:>6.2f}"
            print(f"{row} {over_db:>8.0f} {over_db / raw:>6.2f}", flush=True)
            notes += [rounds.line(processes), rounds.cpu_line(processes, locked_cpu)]
            per_processes[processes] = {
                "raw_jobs_s": raw,
                "rq_wf_s": over_rq,
                "ratio": ratios[processes],
                "worst": worst[processes],
                "rq_locked_wf_s": over_rq_locked,
                "rq_jobs_wf_s": over_rq_jobs,
                "db_wf_s": over_db,
                "rounds": {"raw_jobs_s": rounds.raw, "rq_wf_s": rounds.rq, "ratios": rounds.ratios},
                "cpu_ms_per_item": {"raw": rounds.raw_cpu, "rq": rounds.rq_cpu, "rq_locked": locked_cpu},
            }
        print("\n".join(notes))
        verdicts = [
            target_line("target: over rq (the defaults) / raw RQ, median of the rounds", ratios),
            target_line("worst round (no target): over rq (the defaults) / raw RQ", worst, None),
            target_line("for comparison, OPTIMISTIC_FIRST_STEP off: over rq-locked / raw RQ", locked_ratios, None),
        ]
        print("\n".join(verdicts))
        summary = [
            f"{processes} process(es): raw RQ {row['raw_jobs_s']:.0f} jobs/s; over rq {row['rq_wf_s']:.0f} wf/s"
            f" (ratio {row['ratio']:.2f}, worst round {row['worst']:.2f}); rq-locked {row['rq_locked_wf_s']:.0f},"
            f" rq-jobs {row['rq_jobs_wf_s']:.0f}, over db {row['db_wf_s']:.0f} wf/s"
            for processes, row in per_processes.items()
        ]
        reporting.write_json(
            "transport",
            {"jobs": jobs, "runs": runs, "concurrency": args.concurrency, "processes": per_processes},
            path=args.json,
            summary=summary + verdicts[:2],
            targets=[
                reporting.target(
                    f"over rq / raw RQ at {processes} process(es), median of the rounds", ratio, ">=", goal
                )
                for processes, ratio in ratios.items()
                if (goal := GOALS.get(processes)) is not None
            ],
        )
    finally:
        clear_redis()
        from django.db import connections

        connections.close_all()
        pg_admin(f"DROP DATABASE IF EXISTS {PG_DATABASE} WITH (FORCE)")


if __name__ == "__main__":
    main()
