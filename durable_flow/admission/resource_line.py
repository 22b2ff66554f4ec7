"""One step-concurrency resource's waiting line, indexed so a freed slot finds the rightful next
waiter in O(log n) (the `local` backend's; `resources.lua` and `db_resources` keep the same order).

The order, as the Redis script ranks a freed resource's waiters: higher priority first; then the
waiter whose *other* key was served least recently (under a shared `"openai"` ceiling, the
account whose key was served longest ago; never served beats everything; a call that needs the
resource alone belongs to the resource's `SOLO` group, served in turn like one more key); then
arrival, oldest first (FIFO within a key).

Waiters sharing an other key share its last serve, so the line keeps one heap per group (the
other key) ordered by (priority, arrival), and a top heap holds each group's head with its rank.
As in `waiter_line`, a stored rank can only be *better* than the truth (serves only grow, a
group's next head ranks no better than the last), so the smallest stored entry whose rank is
still current is the best waiter; stale entries are re-pushed or dropped as they surface, and
the heaps are rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection

#: The group of calls that need this resource alone (a resource name is never empty).
SOLO = ""
#: A key never served ranks before every served one.
NEVER_SERVED = -1

Rank = tuple[int, int, int]
Entry = tuple[int, int, str]  # (-priority, arrival, ticket)
#: The last serve of a group's key: `served_of(group)`.
ServedOf = Callable[[str], int]


class ResourceLine:
    """The waiters of one resource by ticket, with `pop_best()` in O(log n) amortized."""

    def __init__(self) -> None:
        self._members: dict[str, tuple[str, Entry]] = {}  # ticket -> (group, entry)
        self._groups: dict[str, list[Entry]] = {}
        self._top: list[tuple[Rank, str]] = []
        self._entries = 0
        self._held: list[tuple[Rank, str]] = []  # top entries of skipped groups

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, ticket: object) -> bool:
        return ticket in self._members

    def add(self, ticket: str, priority: int, arrival: int, group: str) -> None:
        """Index a waiter (a ticket already indexed is replaced)."""
        entry = (-priority, arrival, ticket)
        self._members[ticket] = (group, entry)
        heapq.heappush(self._groups.setdefault(group, []), entry)
        # A bound on its rank were it the group's head: a group whose head ranks better has an
        # entry ranking at least as well already.
        heapq.heappush(self._top, ((entry[0], NEVER_SERVED, entry[1]), group))
        self._entries += 2

    def remove(self, ticket: str) -> None:
        """Forget a waiter (its heap entries go stale and are dropped as they surface)."""
        self._members.pop(ticket, None)

    def pop_best(self, served_of: ServedOf, skipped: Collection[str] = ()) -> str | None:
        """Remove and return the rightful next waiter, or None when the line is empty. Groups in
        `skipped` are passed over whole (their top entries are held until `unskip`)."""
        if not self._held and self._entries > 2 * len(self._members) + 64:
            self._rebuild()
        while self._top:
            stored, group = self._top[0]
            if group in skipped:
                self._held.append(heapq.heappop(self._top))
                continue
            current = self._head_rank(group, served_of)
            if current == stored:
                _, _, ticket = heapq.heappop(self._groups[group])
                self._entries -= 1
                del self._members[ticket]
                return ticket  # the group's stored entry now ranks better than its next head
            if current is None:
                heapq.heappop(self._top)
                self._entries -= 1
            else:
                heapq.heapreplace(self._top, (current, group))
        return None

    def unskip(self) -> None:
        """Put the groups `pop_best` passed over back in the running."""
        for item in self._held:
            heapq.heappush(self._top, item)
        self._held = []

    def _head_rank(self, group: str, served_of: ServedOf) -> Rank | None:
        """The current rank of the group's best live waiter (dropping stale heads), or None."""
        heap = self._groups.get(group)
        while heap:
            neg_priority, arrival, ticket = heap[0]
            if self._members.get(ticket) == (group, heap[0]):
                return (neg_priority, served_of(group), arrival)
            heapq.heappop(heap)
            self._entries -= 1
        self._groups.pop(group, None)
        return None

    def _rebuild(self) -> None:
        self._groups, self._top = {}, []
        for group, entry in self._members.values():
            self._groups.setdefault(group, []).append(entry)
        for group, heap in self._groups.items():
            heapq.heapify(heap)
            self._top.append(((heap[0][0], NEVER_SERVED, heap[0][1]), group))
        heapq.heapify(self._top)
        self._entries = len(self._members) + len(self._groups)
