"""Groups of waiters under a heap of their heads: the index behind `waiter_line` (a queue's
fairness keys) and `resource_line` (a step-concurrency resource's other keys).

Each group (a fairness key, an other key) keeps a heap of entries (-priority, arrival, ticket),
and a top heap holds each group's head with its rank (-priority, the group's last serve,
arrival). A group's rank only gets worse: its key's serve only grows, its next head ranks no
better than the last, and a waiter that joins pushes a fresh bound. So a stored rank is never
worse than the truth, and the smallest stored entry whose rank is still current is the best
waiter: stale top entries are re-pushed with their current rank (or dropped) as they surface.
Entries of waiters that left are dropped lazily, and the owner rebuilds the heaps when stale
entries outnumber live ones (`stale`).

The top heap holds one current entry per group (`bound`: the rank it was stored with): a waiter
joining a group whose stored rank is already no worse than its own bound adds nothing to it, so
a line of 10,000 waiters in one group keeps a top heap of one, not 10,000, and a release and
grant do not slow down as the line grows (`bench/contention.py`'s parked figures; see
docs/benchmark-history.md). An entry whose rank is not its group's `bound` was superseded and is
dropped when it surfaces.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

#: A key never served ranks before every served one (`waiter_line.rank`).
NEVER_SERVED = -1

Rank = tuple[int, int, int]
Entry = tuple[int, int, str]  # (-priority, arrival, ticket)
Live = Callable[[str, Entry], bool]
ServedOf = Callable[[str], int]


class HeadHeap:
    """The heaps of one line. `live(group, entry)` says whether an entry is still its waiter's
    current one; `served_of(group)` gives the group's last serve."""

    def __init__(self) -> None:
        self.groups: dict[str, list[Entry]] = {}
        self.top: list[tuple[Rank, str]] = []
        #: Each group's current entry on the top heap, by the rank it was stored with.
        self.bound: dict[str, Rank] = {}
        self.entries = 0

    def push(self, group: str, entry: Entry) -> None:
        """Index an entry. Its bound on the top heap is its rank were it the head (never served
        ranks best): a group whose head ranks better has an entry ranking at least as well. It
        goes on the top heap only if it beats the group's stored rank."""
        heapq.heappush(self.groups.setdefault(group, []), entry)
        self.entries += 1
        rank = (entry[0], NEVER_SERVED, entry[1])
        stored = self.bound.get(group)
        if stored is None or rank < stored:
            self.bound[group] = rank
            heapq.heappush(self.top, (rank, group))
            self.entries += 1

    def stale(self, live_count: int) -> bool:
        """Whether stale entries outnumber live ones enough to rebuild."""
        return self.entries > 2 * live_count + 64

    def best(self, live: Live, served_of: ServedOf) -> str | None:
        """The group whose head is the rightful next waiter (its entry: `groups[group][0]`),
        or None when no live entry is left."""
        while self.top:
            stored, group = self.top[0]
            if self.bound.get(group) != stored:  # superseded by a better entry of its group
                heapq.heappop(self.top)
                self.entries -= 1
                continue
            current = self._head_rank(group, live, served_of)
            if current == stored:
                return group
            if current is None:
                heapq.heappop(self.top)
                self.bound.pop(group, None)
                self.entries -= 1
            else:
                self.bound[group] = current
                heapq.heapreplace(self.top, (current, group))
        return None

    def pop_head(self, group: str) -> Entry:
        """Remove the group's head (after `best` returned the group). Its top entry now ranks
        better than the group's next head, as the invariant allows."""
        self.entries -= 1
        return heapq.heappop(self.groups[group])

    def rebuild(self, members: Iterable[tuple[str, Entry]]) -> None:
        """Index exactly these (group, entry) pairs, dropping every stale entry."""
        self.groups, self.top, self.bound = {}, [], {}
        for group, entry in members:
            self.groups.setdefault(group, []).append(entry)
        for group, heap in self.groups.items():
            heapq.heapify(heap)
            self.bound[group] = (heap[0][0], NEVER_SERVED, heap[0][1])
            self.top.append((self.bound[group], group))
        heapq.heapify(self.top)
        self.entries = sum(len(heap) for heap in self.groups.values()) + len(self.groups)

    def _head_rank(self, group: str, live: Live, served_of: ServedOf) -> Rank | None:
        """The current rank of the group's best live entry (dropping stale heads), or None."""
        heap = self.groups.get(group)
        while heap:
            if live(group, heap[0]):
                neg_priority, arrival, _ = heap[0]
                return (neg_priority, served_of(group), arrival)
            heapq.heappop(heap)
            self.entries -= 1
        self.groups.pop(group, None)
        return None
