"""One step-concurrency resource's waiting line, indexed so a freed slot finds the rightful next
waiter in O(log n) (the `local` backend's; `resources.lua` and `durable_flow.admission.db.resources`
keep the same order).

The order, as the Redis script ranks a freed resource's waiters: higher priority first; then the
waiter whose *other* key was served least recently (under a shared `"openai"` ceiling, the
account whose key was served longest ago; never served beats everything; a call that needs the
resource alone belongs to the resource's `SOLO` group, served in turn like one more key); then
arrival, oldest first (FIFO within a key).

Waiters sharing an other key share its last serve, so the line keeps one heap per group (the
other key) ordered by (priority, arrival) under a top heap of their heads (`head_heap`, as
`waiter_line` does for a queue's fairness keys).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

from durable_flow.admission.rules.head_heap import NEVER_SERVED, Entry, HeadHeap, Rank, ServedOf

__all__ = ["NEVER_SERVED", "SOLO", "ResourceLine", "ServedOf"]

#: The group of calls that need this resource alone (a resource name is never empty).
SOLO = ""


class ResourceLine:
    """The waiters of one resource by ticket, with `pop_best()` in O(log n) amortized."""

    def __init__(self) -> None:
        self._members: dict[str, tuple[str, Entry]] = {}  # ticket -> (group, entry)
        self._heads = HeadHeap()
        self._held: list[tuple[Rank, str]] = []  # top entries of skipped groups

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, ticket: object) -> bool:
        return ticket in self._members

    def add(self, ticket: str, priority: int, arrival: int, group: str) -> None:
        """Index a waiter (a ticket already indexed is replaced)."""
        entry = (-priority, arrival, ticket)
        self._members[ticket] = (group, entry)
        self._heads.push(group, entry)

    def remove(self, ticket: str) -> None:
        """Forget a waiter (its heap entries go stale and are dropped as they surface)."""
        self._members.pop(ticket, None)

    def pop_best(self, served_of: ServedOf, skipped: Collection[str] = ()) -> str | None:
        """Remove and return the rightful next waiter, or None when the line is empty. Groups in
        `skipped` are passed over whole (their top entries are held until `unskip`)."""
        if not self._held and self._heads.stale(len(self._members)):
            self._heads.rebuild(self._members.values())
        group = self._heads.best(self._live, served_of)
        while group is not None and group in skipped:
            self._held.append(heapq.heappop(self._heads.top))  # `best` left the group's entry on top
            group = self._heads.best(self._live, served_of)
        if group is None:
            return None
        _, _, ticket = self._heads.pop_head(group)
        del self._members[ticket]
        return ticket

    def unskip(self) -> None:
        """Put the groups `pop_best` passed over back in the running."""
        for item in self._held:
            heapq.heappush(self._heads.top, item)
        self._held = []

    def _live(self, group: str, entry: Entry) -> bool:
        return self._members.get(entry[2]) == (group, entry)
