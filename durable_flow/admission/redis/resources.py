"""Step concurrency on the Redis admission backend: the script's source, the constraints as the
script reads them, and the read model (busiest keys).

The rules live in `resources.lua` (key layout there), which is put in front of `admission.lua`
so that one `EVALSHA` decides a call's queue slot and its resource slots together: all or none.
A release frees the ticket's resource slots and grants them, in the same call, to the waiters of
those resources in any queue (priority first; among waiters of a shared resource, the one whose
other key was served least recently; FIFO within a key). Slots of calls gated by their
constraints alone live on the pseudo-queue `""` (its keys `P:q::slots`, `P:q::owners`,
`P:q::waiters`), owned by instances like any queue slot, so a dead process's resource slots are
reclaimed with its queue slots.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from durable_flow.admission.base import AdmissionRequest, Constraint, ResourceUsage
from durable_flow.admission.rules.resources import top_usage

if TYPE_CHECKING:
    from redis import Redis
    from redis.cluster import RedisCluster

HERE = Path(__file__).parent


def lua(*names: str) -> str:
    """The named Lua files of this package, in order, as one script: one atomic call."""
    return "\n".join((HERE / name).read_text() for name in names)


def script_source() -> str:
    """The admission script: `hearing.lua` (may a lapsed heartbeat mean a death), `resources.lua`
    (step concurrency), then `admission.lua`."""
    return lua("hearing.lua", "resources.lua", "admission.lua")


def constraint_args(constraints: Sequence[Constraint]) -> list[Any]:
    """The script's encoding of a call's constraints: count, then (resource, limit) pairs."""
    args: list[Any] = [len(constraints)]
    for c in constraints:
        args += [c.resource, c.limit]
    return args


def reoffer_args(request: AdmissionRequest, priority: int) -> list[Any]:
    """One parked call for the script's `reoffer`: ticket, priority, fairness key, constraints."""
    return [request.ticket, priority, request.key, json.dumps([[c.resource, c.limit] for c in request.constraints])]


def resource_usage(redis: Redis | RedisCluster, roots: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """Per resource (each under its shard's key root): (slots held, calls waiting), by any process."""
    resources = list(roots)
    pipe = redis.pipeline(transaction=False)
    for r in resources:
        pipe.zscore(f"{roots[r]}:res:active", r)
        pipe.zscore(f"{roots[r]}:res:waiting", r)
    values = pipe.execute()
    return {r: (int(values[2 * i] or 0), int(values[2 * i + 1] or 0)) for i, r in enumerate(resources)}


def constraint_usage(
    redis: Redis | RedisCluster, roots: Sequence[str], resource_prefix: str, limit: int
) -> list[ResourceUsage]:
    """The busiest resources whose name starts with `resource_prefix`, in every shard (`roots`):
    most active, then most waiting. Reads the two counter zsets, which hold only resources in
    use (O(resources in use))."""
    counts: dict[str, list[int]] = {}
    for root in roots:
        for index, name in enumerate(("active", "waiting")):
            for member, score in redis.zscan_iter(f"{root}:res:{name}", match=_glob(resource_prefix) + "*", count=500):
                resource = member.decode() if isinstance(member, bytes) else str(member)
                counts.setdefault(resource, [0, 0])[index] = int(score)
    return top_usage({r: (a, w) for r, (a, w) in counts.items()}, limit)


def _glob(text: str) -> str:
    """`text` with Redis glob metacharacters escaped (a key may contain them)."""
    return "".join(f"\\{ch}" if ch in "*?[]\\" else ch for ch in text)
