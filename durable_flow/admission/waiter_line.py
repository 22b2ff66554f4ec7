"""A queue's waiters by ticket, indexed so the rightful next one is found in O(log n).

The `local` backend's grant used to scan every waiter for the best `rank` on each release:
with 10,000 parked calls, a handoff cost 10,000 comparisons under the backend's lock. Here the
waiters are kept in one heap per bucket (a fairness key, or one bucket for a `fifo`-fair
queue) ordered by (priority, arrival), and a top heap holds each bucket's head with its rank.

The rank of a bucket's head changes when its key is served (`served` only grows, so the rank
only gets worse), when its head leaves (the next head ranks no better) or when a waiter joins
(a new entry is pushed). Every change either pushes a fresh entry or makes the stored one rank
*better* than the truth, so the smallest stored entry whose rank is still current is the best
waiter: stale entries are re-pushed with their current rank (or dropped) as they surface.
Removed waiters are dropped from the heaps lazily, and the heaps are rebuilt when stale entries
outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from durable_flow.admission.policy import Waiter
    from durable_flow.queues import QueueConfig

Rank = tuple[int, int, int]
#: A key never served ranks before every served one (`policy.rank`).
NEVER_SERVED = -1
#: (fair by key, oldest first): how the heaps were built.
Mode = tuple[bool, bool]


class WaiterLine(MutableMapping[str, "Waiter"]):
    """Waiters by ticket, with `best()` in O(log n) amortized. A waiter changed in place must
    be stored again (`line[ticket] = waiter`) so the index sees the change."""

    def __init__(self) -> None:
        self._waiters: dict[str, Waiter] = {}
        self._constrained: set[str] = set()
        self._mode: Mode = (False, True)
        self._buckets: dict[str, list[tuple[int, int, str]]] = {}
        self._top: list[tuple[Rank, str]] = []
        self._entries = 0

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
        self._index(waiter)

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
        """The waiter `policy.rank` puts first, or None when the line is empty."""
        mode: Mode = (config.fairness == "key", config.order == "fifo")
        if mode != self._mode or self._entries > 2 * len(self._waiters) + 64:
            self._rebuild(mode)
        while self._top:
            stored, bucket = self._top[0]
            current = self._head_rank(bucket, served)
            if current == stored:
                return self._waiters[self._buckets[bucket][0][2]]
            if current is None:
                heapq.heappop(self._top)
                self._entries -= 1
            else:
                heapq.heapreplace(self._top, (current, bucket))
        return None

    def _bucket_of(self, waiter: Waiter) -> str:
        return waiter.fairness_key if self._mode[0] else ""

    def _entry(self, waiter: Waiter) -> tuple[int, int, str]:
        return (-waiter.priority, waiter.arrival if self._mode[1] else -waiter.arrival, waiter.ticket)

    def _index(self, waiter: Waiter) -> None:
        bucket = self._bucket_of(waiter)
        entry = self._entry(waiter)
        heapq.heappush(self._buckets.setdefault(bucket, []), entry)
        # A bound on the new entry's rank were it the head (never served ranks best); a bucket
        # whose head ranks better has an entry that ranks at least as well already.
        heapq.heappush(self._top, ((entry[0], NEVER_SERVED, entry[1]), bucket))
        self._entries += 2

    def _head_rank(self, bucket: str, served: dict[str, int]) -> Rank | None:
        """The current rank of the bucket's best live waiter (dropping stale heads), or None."""
        heap = self._buckets.get(bucket)
        while heap:
            neg_priority, arrival, ticket = heap[0]
            waiter = self._waiters.get(ticket)
            if waiter is not None and self._entry(waiter) == heap[0] and self._bucket_of(waiter) == bucket:
                key_served = served.get(bucket, NEVER_SERVED) if self._mode[0] else 0
                return (neg_priority, key_served, arrival)
            heapq.heappop(heap)
            self._entries -= 1
        self._buckets.pop(bucket, None)
        return None

    def _rebuild(self, mode: Mode) -> None:
        self._mode = mode
        self._buckets, self._top, self._entries = {}, [], 0
        for waiter in self._waiters.values():
            self._buckets.setdefault(self._bucket_of(waiter), []).append(self._entry(waiter))
        for bucket, heap in self._buckets.items():
            heapq.heapify(heap)
            self._top.append(((heap[0][0], NEVER_SERVED, heap[0][1]), bucket))
        heapq.heapify(self._top)
        self._entries = 2 * len(self._waiters)
