#!/usr/bin/env python
"""Fairness under a flood: Jain's index of admissions per tenant, `fairness="key"` vs FIFO.

    .venv/bin/python bench/fairness.py            # local, db (SQLite), redis
    .venv/bin/python bench/fairness.py --json out.json   # the figures there (default var/bench/fairness.json)

Ten tenants share a queue with one slot. Tenant 0 floods: for every call of each other tenant
it makes ten, interleaved in arrival order (`--cycles` rounds of 10 + 9 calls). Every call asks
once while the slot is held, so all of them wait in line; then the slot is handed on
`--admissions` times (release the holder, admit the rightful next waiter). Every tenant still has
calls waiting at the end, so a fair queue should serve them equally. The figure is Jain's index
over the ten per-tenant admission counts, (sum x)^2 / (n * sum x^2): 1.0 is perfectly even,
1/n is one tenant taking everything. Target under `fairness="key"`: >= 0.99. FIFO is the
baseline, measured in the same run: there the flooder gets about ten calls in nineteen.

Each release hands the slot on in the same atomic operation (handoff): the backend's `Grant`
names the waiter it chose, and that is the admission counted, on every backend alike.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reporting  # noqa: E402 - bench/ is on the path of a script run from it

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
TENANTS = 10
FLOOD = 10


def jain(counts: list[int]) -> float:
    """Jain's fairness index of `counts`: 1.0 when all are equal."""
    total = sum(counts)
    squares = sum(count * count for count in counts)
    return total * total / (len(counts) * squares) if squares else 1.0


def setup_django() -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "settings.test"
    os.environ["DURABLE_FLOW_TEST_ID"] = "fairbench"
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("DURABLE_FLOW_SUBPROCESS", None)
    for suffix in ("", "-wal", "-shm"):
        (ROOT / "var" / f"test-fairbench.sqlite3{suffix}").unlink(missing_ok=True)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def flood(backend: Any, fairness: str, cycles: int, admissions: int) -> list[int]:
    """Admissions per tenant after `admissions` hand-overs of one slot, as described above."""
    from durable_flow.admission.base import AdmissionRequest
    from durable_flow.config.queues import QueueConfig

    queue = f"fair-{fairness}-{uuid.uuid4().hex[:8]}"
    backend.register(QueueConfig(name=queue, concurrency=1, retry_ms=60_000, fairness=fairness))
    holder = "holder/1"
    assert backend.try_admit(AdmissionRequest(queue, holder, fairness_key="holder")).admitted
    line: list[AdmissionRequest] = []
    for cycle in range(cycles):
        calls = [0] * FLOOD + list(range(1, TENANTS))
        line.extend(AdmissionRequest(queue, f"c{cycle}-{i}/1", fairness_key=f"t{t}") for i, t in enumerate(calls))
    tenant_of = {request.ticket: int(request.fairness_key[1:]) for request in line}
    for request in line:
        assert not backend.try_admit(request).admitted
    counts = [0] * TENANTS
    for _ in range(admissions):
        granted = backend.release(queue, holder).tickets
        assert len(granted) == 1, f"one freed slot, granted to {granted}"
        holder = granted[0]
        counts[tenant_of[holder]] += 1
    return counts


def backends(with_redis: bool) -> list[tuple[str, Any, Any]]:
    """(name, backend, cleanup) for every backend measured."""
    from durable_flow.admission.db.backend import DatabaseAdmissionBackend
    from durable_flow.admission.local import LocalAdmissionBackend

    found: list[tuple[str, Any, Any]] = [
        ("local", LocalAdmissionBackend(), None),
        ("db (SQLite)", DatabaseAdmissionBackend(), None),
    ]
    if with_redis:
        from redis import Redis

        from durable_flow.admission.redis.backend import RedisAdmissionBackend

        prefix = f"bench:fair:{uuid.uuid4().hex[:8]}"

        def cleanup() -> None:
            client = Redis.from_url(REDIS_URL)
            keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                client.delete(*keys)

        found.append(("redis", RedisAdmissionBackend(url=REDIS_URL, key_prefix=prefix), cleanup))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20, help="arrival rounds (10 flood calls + 9 others each)")
    parser.add_argument("--admissions", type=int, default=100, help="slot hand-overs measured")
    parser.add_argument("--no-redis", action="store_true")
    reporting.add_json_option(parser, "fairness")
    args = parser.parse_args()
    if args.admissions > args.cycles * TENANTS:
        parser.error("--admissions must leave every tenant calls waiting: at most 10 x --cycles")
    reporting.log("migrating a fresh SQLite database")
    setup_django()
    results: dict[str, dict[str, Any]] = {}
    for name, backend, cleanup in backends(not args.no_redis):
        reporting.log(f"{name}: fairness='key', then FIFO")
        try:
            row = {}
            for fairness in ("key", "fifo"):
                counts = flood(backend, fairness, args.cycles, args.admissions)
                row[fairness] = {"counts": counts, "jain": jain(counts)}
            results[name] = row
        finally:
            if cleanup is not None:
                cleanup()
    print(f"{TENANTS} tenants, tenant 0 makes {FLOOD}x the calls; {args.admissions} admissions through one slot")
    print(f"{'backend':<12} {'key: Jain':>10} {'fifo: Jain':>11}   admissions per tenant (key | fifo)")
    for name, row in results.items():
        key, fifo = row["key"], row["fifo"]
        print(f"{name:<12} {key['jain']:>10.3f} {fifo['jain']:>11.3f}   {key['counts']} | {fifo['counts']}")
    worst = min(row["key"]["jain"] for row in results.values())
    print(f"target fairness='key' >= 0.99: {'met' if worst >= 0.99 else 'MISSED'} (worst {worst:.3f})")
    summary = [
        f'{name}: Jain {row["key"]["jain"]:.3f} under fairness="key" vs {row["fifo"]["jain"]:.3f} under FIFO'
        for name, row in results.items()
    ]
    reporting.write_json(
        "fairness",
        {"tenants": TENANTS, "admissions": args.admissions, "backends": results},
        path=args.json,
        summary=summary,
        targets=[
            reporting.target(f'{name}: Jain under fairness="key"', row["key"]["jain"], ">=", 0.99)
            for name, row in results.items()
        ],
    )


if __name__ == "__main__":
    main()
