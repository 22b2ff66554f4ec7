"""A queue's waiters by ticket, indexed so the rightful next one is found in O(log n).

The `local` backend's grant used to scan every waiter for the best `rank` on each release:
with 10,000 parked calls, a handoff cost 10,000 comparisons under the backend's lock. Here the
waiters are kept in one heap per bucket (a fairness key, or one bucket for a `fifo`-fair
queue) ordered by (priority, arrival), and a top heap holds each bucket's head with its rank.

The index (`head_heap`, shared with `resource_line`) re-ranks a bucket's head lazily as its
key is served; removed waiters are dropped from the heaps as they surface, and the heaps are
rebuilt when stale entries outnumber live ones or the queue's mode changes.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from durable_flow.admission.base import Constraint
from durable_flow.admission.rules.head_heap import NEVER_SERVED, Entry, HeadHeap

if TYPE_CHECKING:
    from durable_flow.config.queues import QueueConfig


@dataclass(slots=True)
class Waiter:
    """A blocked call, remembered so the rightful next one gets the slot."""

    ticket: str
    priority: int
    fairness_key: str
    arrival: int
    seen_ms: int
    constraints: tuple[Constraint, ...] = ()


def rank(waiter: Waiter, config: QueueConfig, served: dict[str, int]) -> tuple[int, int, int]:
    """Sort key: the smallest tuple is the rightful next waiter."""
    key_served = served.get(waiter.fairness_key, NEVER_SERVED) if config.fairness == "key" else 0
    arrival = waiter.arrival if config.order == "fifo" else -waiter.arrival
    return (-waiter.priority, key_served, arrival)


#: (fair by key, oldest first): how the heaps were built.
Mode = tuple[bool, bool]


class WaiterLine(MutableMapping[str, "Waiter"]):
    """Waiters by ticket, with `best()` in O(log n) amortized. A waiter changed in place must
    be stored again (`line[ticket] = waiter`) so the index sees the change."""

    def __init__(self) -> None:
        self._waiters: dict[str, Waiter] = {}
        self._constrained: set[str] = set()
        self._mode: Mode = (False, True)
        self._heads = HeadHeap()

    # -- the mapping -------------------------------------------------------------------------
    def __getitem__(self, ticket: str) -> Waiter:
        return self._waiters[ticket]

    def __contains__(self, ticket: object) -> bool:
        return ticket in self._waiters

    def __setitem__(self, ticket: str, waiter: Waiter) -> None:
        self._waiters[ticket] = waiter
        if waiter.constraints:
            self._constrained.add(ticket)
        else:
            self._constrained.discard(ticket)
        self._heads.push(self._bucket_of(waiter), self._entry(waiter))

    def __delitem__(self, ticket: str) -> None:
        del self._waiters[ticket]  # its heap entries go stale and are dropped as they surface
        self._constrained.discard(ticket)

    def __iter__(self) -> Iterator[str]:
        return iter(self._waiters)

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def any_constrained(self) -> bool:
        """Whether some waiter has step-concurrency constraints (then the caller must check fits)."""
        return bool(self._constrained)

    # -- the index ---------------------------------------------------------------------------
    def best(self, config: QueueConfig, served: dict[str, int]) -> Waiter | None:
        """The waiter `rank` puts first, or None when the line is empty."""
        mode: Mode = (config.fairness == "key", config.order == "fifo")
        if mode != self._mode or self._heads.stale(len(self._waiters)):
            self._mode = mode
            self._heads.rebuild((self._bucket_of(w), self._entry(w)) for w in self._waiters.values())
        if mode[0]:
            bucket = self._heads.best(self._live, lambda key: served.get(key, NEVER_SERVED))
        else:
            bucket = self._heads.best(self._live, lambda _: NEVER_SERVED)  # one bucket: as pushed
        return None if bucket is None else self._waiters[self._heads.groups[bucket][0][2]]

    def _bucket_of(self, waiter: Waiter) -> str:
        return waiter.fairness_key if self._mode[0] else ""

    def _entry(self, waiter: Waiter) -> Entry:
        return (-waiter.priority, waiter.arrival if self._mode[1] else -waiter.arrival, waiter.ticket)

    def _live(self, bucket: str, entry: Entry) -> bool:
        waiter = self._waiters.get(entry[2])
        return waiter is not None and self._entry(waiter) == entry and self._bucket_of(waiter) == bucket
