#!/usr/bin/env python
"""Admission decisions against the length of the line: does a decision cost the same with
100 waiters as with 10,000?

    .venv/bin/python bench/waiters.py                 # 100, 1,000, 10,000 waiters (~1 min)
    .venv/bin/python bench/waiters.py --quick         # shorter loops
    .venv/bin/python bench/waiters.py --waiters 100,1000,10000,50000

For each line length and each backend (`local`; `db` on a fresh SQLite file; `redis` under a
unique key prefix, deleted after), bench/admission.py's `measure_backend` fills a queue of
concurrency 5 (every slot held) with that many waiters and times, for a fixed time each:
a *cap-full decision* (`try_admit` of the waiter in the middle, refused for `concurrency`) and a
*handoff* (a holder's release granting its slot to the rightful next waiter in the same call).
The baseline is the shortest line, measured in the same run: a backend whose decision walks an
index stays near 1.0x at every length; one that scans the line falls as 1 / waiters (`local`'s
next-waiter search does, by design: see docs/roadmap.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import admission
import reporting

KINDS = (("cap full", "cap_full"), ("handoff", "rank"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter timed loops")
    parser.add_argument("--waiters", default="100,1000,10000", help="comma-separated line lengths")
    parser.add_argument("--seconds", type=float, default=None, help="duration of each timed loop")
    reporting.add_json_option(parser, "waiters")
    return parser.parse_args()


def measure(sizes: list[int], seconds: float) -> dict[str, dict[int, dict[str, Any]]]:
    """{backend: {waiters: measure_backend's figures}}, every backend at every size."""
    from durable_flow.admission.db.backend import DatabaseAdmissionBackend
    from durable_flow.admission.local import LocalAdmissionBackend
    from durable_flow.admission.redis.backend import RedisAdmissionBackend

    prefix = f"bench:waiters:{uuid.uuid4().hex[:12]}"
    redis_backend = RedisAdmissionBackend(url=admission.REDIS_URL, key_prefix=prefix)
    rows: dict[str, dict[int, dict[str, Any]]] = {"local": {}, "db (SQLite)": {}, "redis": {}}
    try:
        # A discarded pass at the shortest line first, so connections, prepared statements and
        # the Lua script's load are not charged to the baseline.
        admission.measure_backend(DatabaseAdmissionBackend(), seconds / 3, fill=admission.db_fill, waiters=sizes[0])
        admission.measure_backend(redis_backend, seconds / 3, waiters=sizes[0])
        for size in sizes:
            with reporting.progress(f"{size:,} waiters: local, db (SQLite), redis", total=3, unit="backends") as shown:
                # A fresh local backend per size: its line is never emptied, only handed on.
                rows["local"][size] = admission.measure_backend(LocalAdmissionBackend(), seconds, waiters=size)
                shown.advance()
                rows["db (SQLite)"][size] = admission.measure_backend(
                    DatabaseAdmissionBackend(), seconds, fill=admission.db_fill, waiters=size
                )
                shown.advance()
                rows["redis"][size] = admission.measure_backend(redis_backend, seconds, waiters=size)
                shown.advance()
    finally:
        redis_backend.close()
        import redis

        client = redis.Redis.from_url(admission.REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
    return rows


def main() -> None:
    args = parse_args()
    sizes = sorted(int(size) for size in args.waiters.split(","))
    seconds = args.seconds or (0.3 if args.quick else 1.0)
    test_id = f"bench-waiters-{os.getpid()}"
    admission.setup_django(None, test_id=test_id)
    try:
        rows = measure(sizes, seconds)
    finally:
        from django.db import connections

        connections.close_all()
        for suffix in ("", "-wal", "-shm"):
            (admission.ROOT / "var" / f"test-{test_id}.sqlite3{suffix}").unlink(missing_ok=True)

    print(f"Admission per second against waiters in line (concurrency 5, every slot held; {seconds:g} s per loop)")
    print(f"{'backend':<14}{'waiters':>8}{'cap full/s':>12}{'p50 µs':>8}{'handoff/s':>11}{'p50 µs':>8}")
    for name, by_size in rows.items():
        for size, row in by_size.items():
            full, rank = row["cap_full"], row["rank"]
            print(
                f"{name:<14}{size:>8,}{full['per_s']:>12,.0f}{full['p50_us']:>8.0f}"
                f"{rank['per_s']:>11,.0f}{rank['p50_us']:>8.0f}"
            )
    print(f"ratio {sizes[-1]:,} / {sizes[0]:,} waiters (1.00 = flat; baseline the shortest line, same run):")
    summary = [f"ratio {sizes[-1]:,} / {sizes[0]:,} waiters (1.00 = flat):"]
    ratios: dict[str, dict[str, float]] = {}
    for name, by_size in rows.items():
        ratios[name] = {key: by_size[sizes[-1]][key]["per_s"] / by_size[sizes[0]][key]["per_s"] for _, key in KINDS}
        summary.append(f"{name}: " + ", ".join(f"{label} {ratios[name][key]:.2f}" for label, key in KINDS))
        print(f"  {summary[-1]}")
    reporting.write_json(
        "waiters",
        {"seconds": seconds, "waiters": sizes, "backends": rows, "ratios": ratios},
        path=args.json,
        summary=summary,
    )


if __name__ == "__main__":
    main()
