#!/usr/bin/env python
"""The `rq` transport's claim: what an idle worker costs Redis, and how soon it wakes for a job.

    .venv/bin/python bench/rq_claim.py            # ~30 s

On a redis-server this bench starts on a free port (so no other client's commands count):

* idle: the claim loop of an idle `durable_worker` (`RQTaskSource.claim` with the runtime's
  0.2 s wait) for 10 s on empty queues; Redis round trips per wait (commands sent by the client:
  the pop script and the doorbell's `BLPOP`) and commands Redis ran per second (counting the
  script's own). A busy-polling loop would show many round trips per wait; the target is 2.
* drain: 2,000 jobs enqueued through the transport one by one, then claimed 8 at a time and
  finished (`done`), in this process: jobs/s of each side (run it on two checkouts to compare).
* wake: a claim blocked on the doorbell, then one job enqueued through the transport; time
  from the enqueue call to the claim returning the job, median of 50. Baseline, same server, same
  run: a client blocked in `BLPOP` woken by an `RPUSH` from another (the least a wake can cost).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

CLIENT_COMMANDS = ("evalsha", "eval", "blpop", "lmpop", "blmpop")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    reporting.add_json_option(parser, "rq_claim")
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of the idle claim loop (default 10)")
    parser.add_argument("--jobs", type=int, default=2000, help="jobs of the drain (default 2,000)")
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        os.environ.update(
            {
                "REDIS_URL": f"redis://127.0.0.1:{port}/1",
                "DJANGO_SETTINGS_MODULE": "settings.test",
                "DURABLE_FLOW_TEST_ID": "bench-rq-claim",
            }
        )
        import django

        django.setup()
        run(port, args.json, args.idle_s, args.jobs)
    finally:
        server.kill()
        server.wait(10)


def run(port: int, json_path: Path | None, idle_s: float, jobs: int) -> None:
    from redis import Redis

    from durable_flow.transports.rq import RQTransport

    transport = RQTransport(queue="durable")
    source = transport.source()
    source.execution_ttl_s = 60  # no worker record: `open` is not needed to claim
    redis = Redis(port=port, db=1)

    def sent() -> int:
        stats = redis.info("commandstats")
        return sum(v["calls"] for k, v in stats.items() if k.removeprefix("cmdstat_") in CLIENT_COMMANDS)

    def ran() -> int:
        return int(redis.info("stats")["total_commands_processed"])

    source.claim("bench", 8, 0)  # loads the script
    reporting.log(f"idle: {idle_s:g} s of an idle claim loop")
    waits, sent0, ran0, began = 0, sent(), ran(), time.monotonic()
    while time.monotonic() - began < idle_s:
        source.claim("bench", 8, 0.2)
        waits += 1
    elapsed = time.monotonic() - began
    per_wait = (sent() - sent0) / waits
    commands_s = (ran() - ran0 - 2) / elapsed  # less the two INFO calls
    print(
        f"idle: {waits} waits of 0.2 s, {per_wait:.2f} round trips per wait (target <= 2), {commands_s:.1f} commands/s"
    )

    def wake(block: threading.Thread, push: callable) -> float:  # type: ignore[valid-type]
        block.start()
        time.sleep(0.05)  # let it block (the bench's pacing, not a verdict)
        began = time.perf_counter()
        push()
        block.join(10)
        return (time.perf_counter() - began) * 1000

    blocker = Redis(port=port, db=1)
    baseline = [
        wake(
            threading.Thread(target=lambda: blocker.blpop(["bench:bell"], timeout=5)),
            lambda: redis.rpush("bench:bell", 1),
        )
        for _ in range(50)
    ]
    reporting.log("wake: 50 claims woken by an enqueue")
    claims: list[float] = []
    for attempt in range(50):
        got: list[object] = []
        blocked = threading.Thread(target=lambda got=got: got.extend(source.claim("bench", 8, 5.0)))
        claims.append(wake(blocked, lambda a=attempt: transport.enqueue_step("r", "k", a, 0)))
        if len(got) != 1:
            raise RuntimeError("the claim did not return the enqueued job")
    for task in source.claim("bench", 64, 0):  # the wake section's jobs, out of the way
        source.done("bench", task)
    began = time.perf_counter()
    for n in range(jobs):
        transport.enqueue_step("r", "k", n, 0)
    enqueued = time.perf_counter() - began
    began, drained = time.perf_counter(), 0
    while drained < jobs:
        tasks = source.claim("bench", 8, 0)
        for task in tasks:
            source.done("bench", task)
        drained += len(tasks)
    claimed = time.perf_counter() - began
    print(
        f"drain: {jobs} jobs enqueued at {jobs / enqueued:.0f}/s, "
        f"claimed 8 at a time and finished at {jobs / claimed:.0f}/s"
    )
    base, ours = statistics.median(baseline), statistics.median(claims)
    print(f"wake: enqueue -> claimed median {ours:.2f} ms (max {max(claims):.1f}); BLPOP woken by RPUSH {base:.2f} ms")
    print(
        f"ratio {ours / base:.1f}x the bare wake (the enqueue writes the job; the claim pops, reads and registers it)"
    )
    reporting.write_json(
        "rq_claim",
        {
            "idle": {"waits": waits, "round_trips_per_wait": per_wait, "commands_s": commands_s},
            "drain": {"jobs": jobs, "enqueued_s": jobs / enqueued, "claimed_s": jobs / claimed},
            "wake": {"claim_ms": claims, "blpop_ms": baseline, "median_ms": ours, "blpop_median_ms": base},
            "wake_ratio": ours / base,
        },
        path=json_path,
        summary=[
            f"idle: {per_wait:.2f} round trips per 0.2 s wait (target <= 2), {commands_s:.1f} commands/s",
            f"wake: enqueue -> claimed median {ours:.2f} ms, {ours / base:.1f}x a bare BLPOP woken by RPUSH",
        ],
        targets=[reporting.target("idle round trips per wait", per_wait, "<=", 2)],
    )


if __name__ == "__main__":
    main()
