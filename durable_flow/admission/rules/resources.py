"""Step-concurrency resources, as pure in-memory rules (the `local` backend's; `db` states the
same rules in SQL and `redis` in Lua): who holds a slot of which resource, and who waits for one.

A resource (`sc:fn:<workflow>:<key>`, ...) has no limit of its own: each call carries its limit
(`Constraint`) and fits while the resource's held count is below it. A call takes the slots of
all its constraints together with its queue slot, or none of them. When a holder releases, the
freed resources are offered to the calls waiting for them, across queues, in the order of
`resource_line`: priority first; then, among the waiters of a shared resource, the one whose
other key was served least recently (so one account's backlog on a shared ceiling cannot starve
the others); then arrival (best-effort FIFO within a key). A waiter whose own key is full is
passed over with the rest of its key; one another gate still blocks (its queue is full or
paused) is passed over alone; both keep their place, so one blocked call never holds up the others.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from durable_flow.admission.base import Constraint, ResourceUsage
from durable_flow.admission.rules.queue_state import QueueState, room, take_slot
from durable_flow.admission.rules.resource_line import NEVER_SERVED, SOLO, ResourceLine

#: How many waiters (passed over alone: their queue full or paused) or keys (passed over whole:
#: their own key full) one freed resource's offer passes over at most before it stops, on every
#: backend: the work of a release stays bounded. Those further back are granted by a later
#: release, their queue's grant, or the poller's `grant("")`.
MAX_SCAN = 5_000


@dataclass(frozen=True, slots=True)
class Need:
    """What a waiting ticket waits for: its queue, place in line and constraints."""

    queue: str
    priority: int
    arrival: int
    constraints: tuple[Constraint, ...]


#: `ResourceState.offer`'s question to the backend: give this waiter its queue slot now? (None:
#: the waiter is gone from its queue; its stale entry is dropped.)
Gate = Callable[["Need", str], "bool | None"]


def group_of(constraints: Sequence[Constraint], resource: str) -> str:
    """The key a waiter of `resource` is ranked by: its other resource (the first that is not
    `resource`, as the Redis script reads it), or `SOLO` when it needs `resource` alone."""
    return next((c.resource for c in constraints if c.resource != resource), SOLO)


def key_full(constraints: Sequence[Constraint], resource: str, active: Callable[[str], int]) -> bool:
    """Whether a waiter of `resource` is blocked by its own key (its other resource is at the
    waiter's limit there): then its key's later calls are passed over with it."""
    key = group_of(constraints, resource)
    return key != SOLO and any(c.resource == key and active(key) >= c.limit for c in constraints)


@dataclass
class ResourceState:
    """Every resource's holders and waiters, across the backend's queues."""

    held: dict[str, set[str]] = field(default_factory=dict)  # resource -> tickets holding it
    holdings: dict[str, tuple[str, ...]] = field(default_factory=dict)  # ticket -> resources held
    needs: dict[str, Need] = field(default_factory=dict)  # waiting ticket -> what it waits for
    lines: dict[str, ResourceLine] = field(default_factory=dict)  # resource -> its ranked waiters
    limits: dict[str, Counter[int]] = field(default_factory=dict)  # resource -> its waiters' limits
    served: dict[str, int] = field(default_factory=dict)  # resource -> serve number of its last take
    solo: dict[str, int] = field(default_factory=dict)  # resource -> last take of it alone
    next_arrival: int = 0
    next_serve: int = 0

    def active(self, resource: str) -> int:
        """Slots of `resource` held now."""
        return len(self.held.get(resource, ()))

    def fits(self, constraints: Sequence[Constraint]) -> bool:
        """Whether every constraint has room for one more (each against its own limit)."""
        return all(self.active(c.resource) < c.limit for c in constraints)

    def wait(self, ticket: str, queue: str, priority: int, constraints: Sequence[Constraint]) -> None:
        """Index a waiter under each resource it needs (keeping its arrival if it has one)."""
        if not constraints:
            return
        old = self.needs.get(ticket)
        arrival = old.arrival if old is not None else self.next_arrival
        if old is None:
            self.next_arrival += 1
        self.unwait(ticket)
        need = Need(queue, priority, arrival, tuple(constraints))
        self.needs[ticket] = need
        for c in need.constraints:
            self.limits.setdefault(c.resource, Counter())[c.limit] += 1
            self._index(ticket, need, c.resource)

    def _index(self, ticket: str, need: Need, resource: str) -> None:
        line = self.lines.setdefault(resource, ResourceLine())
        line.add(ticket, need.priority, need.arrival, group_of(need.constraints, resource))

    def unwait(self, ticket: str) -> None:
        """Forget a waiter (granted or withdrawn)."""
        need = self.needs.pop(ticket, None)
        if need is None:
            return
        for c in need.constraints:
            line = self.lines.get(c.resource)
            if line is not None:
                line.remove(ticket)
                if not line:
                    del self.lines[c.resource]
            limits = self.limits[c.resource]
            limits[c.limit] -= 1
            if limits[c.limit] <= 0:
                del limits[c.limit]
                if not limits:
                    del self.limits[c.resource]

    def take(self, ticket: str, constraints: Sequence[Constraint]) -> None:
        """The ticket holds a slot of each of its resources; they count as served now."""
        self.unwait(ticket)
        if not constraints:
            return
        serve = self.next_serve
        self.next_serve += 1
        for c in constraints:
            self.held.setdefault(c.resource, set()).add(ticket)
            self.served[c.resource] = serve
        if len(constraints) == 1:
            self.solo[constraints[0].resource] = serve
        self.holdings[ticket] = tuple(c.resource for c in constraints)

    def free(self, ticket: str) -> tuple[str, ...]:
        """Give back the ticket's resource slots; returns the resources freed."""
        resources = self.holdings.pop(ticket, ())
        for resource in resources:
            holders = self.held.get(resource)
            if holders is not None:
                holders.discard(ticket)
                if not holders:
                    del self.held[resource]
        return resources

    def waiting_on(self, resource: str) -> int:
        """Calls waiting for a slot of `resource`."""
        return sum(self.limits.get(resource, Counter()).values())

    def ceiling(self, resource: str) -> int:
        """The highest limit among the waiters of `resource` (0 when none waits): while that many
        are held, nobody waiting fits."""
        return max(self.limits.get(resource, ()), default=0)

    def offer(self, resource: str, grant: Gate, paused: Collection[str]) -> list[str]:
        """Offer free slots of `resource` to its waiters, best first (`resource_line`; each grant
        re-ranks its key), until it is full for all of them; `grant(need, ticket)` gives a waiter
        its queue slot if that queue has room. A waiter whose own key is full passes over its
        whole key (its key's later calls are blocked alike); one of a paused queue, or one
        another gate blocks, is passed over alone. Both keep their place. At most `MAX_SCAN`
        are passed over."""
        line = self.lines.get(resource)
        granted: list[str] = []
        if line is None:
            return granted
        ceiling = self.ceiling(resource)
        aside: list[tuple[str, Need]] = []
        skipped: set[str] = set()
        passed = 0
        try:
            while self.active(resource) < ceiling and passed < MAX_SCAN:
                ticket = line.pop_best(lambda group: self._rank_of(resource, group), skipped)
                if ticket is None:
                    break
                need = self.needs[ticket]
                if need.queue in paused:
                    aside.append((ticket, need))
                    passed += 1
                    continue
                if key_full(need.constraints, resource, self.active):
                    skipped.add(group_of(need.constraints, resource))
                    aside.append((ticket, need))
                    passed += 1
                    continue
                ok = self.fits(need.constraints) and grant(need, ticket)
                if ok:
                    self.take(ticket, need.constraints)
                    granted.append(ticket)
                elif ok is None:
                    self.unwait(ticket)  # withdrawn from its queue without its resource entry
                else:
                    aside.append((ticket, need))
                    passed += 1
        finally:
            line.unskip()
            for ticket, need in aside:
                if self.needs.get(ticket) is need:
                    self._index(ticket, need, resource)
        return granted

    def _rank_of(self, resource: str, group: str) -> int:
        table, name = (self.solo, resource) if group == SOLO else (self.served, group)
        return table.get(name, NEVER_SERVED)


def grant_freed(
    queues: Mapping[str, QueueState],
    resources: ResourceState,
    freed: Iterable[str],
    now_ms: int,
    paused: Collection[str] = (),
) -> list[str]:
    """Offer freed resources to their waiters, across queues (`ResourceState.offer`): a waiter is
    granted only if its queue is not paused and has room, and all its constraints fit."""

    def gate(need: Need, ticket: str) -> bool | None:
        state = queues.get(need.queue)
        waiter = state.waiters.get(ticket) if state is not None else None
        if state is None or waiter is None:
            return None
        available = room(state, now_ms)
        if available is not None and available <= 0:
            return False
        take_slot(state, waiter, now_ms)
        return True

    granted: list[str] = []
    for resource in dict.fromkeys(freed):
        granted += resources.offer(resource, gate, paused)
    return granted


def top_usage(counts: dict[str, tuple[int, int]], limit: int) -> list[ResourceUsage]:
    """The `limit` busiest of `counts` (resource -> (active, waiting)): most active, then most
    waiting, then by name; resources with neither are left out."""
    ranked = sorted(
        (item for item in counts.items() if item[1][0] or item[1][1]), key=lambda i: (-i[1][0], -i[1][1], i[0])
    )
    return [ResourceUsage(resource, active, waiting) for resource, (active, waiting) in ranked[:limit]]
