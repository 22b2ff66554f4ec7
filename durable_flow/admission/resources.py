"""Step-concurrency resources, as pure in-memory rules (the `local` backend's; `db` states the
same rules in SQL): who holds a slot of which resource, and who waits for one.

A resource (`sc:fn:<workflow>:<key>`, ...) has no limit of its own: each call carries its limit
(`Constraint`) and fits while the resource's held count is below it. A call takes the slots of
all its constraints together with its queue slot, or none of them. When a holder releases, the
freed resources are offered to the calls waiting for them, across queues: by priority, then
arrival (best-effort FIFO within a resource), skipping any that another gate (its queue, its
other constraint) still blocks, so one blocked call never holds up the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from durable_flow.admission.base import Constraint, ResourceUsage

if TYPE_CHECKING:
    from durable_flow.admission.policy import QueueState


@dataclass
class ResourceState:
    """Every resource's holders and waiters, across the backend's queues."""

    held: dict[str, set[str]] = field(default_factory=dict)  # resource -> tickets holding it
    holdings: dict[str, tuple[str, ...]] = field(default_factory=dict)  # ticket -> resources held
    waiting: dict[str, dict[str, str]] = field(default_factory=dict)  # resource -> {ticket: queue}
    arrival: dict[str, int] = field(default_factory=dict)  # waiting ticket -> global arrival
    next_arrival: int = 0

    def active(self, resource: str) -> int:
        """Slots of `resource` held now."""
        return len(self.held.get(resource, ()))

    def fits(self, constraints: Sequence[Constraint]) -> bool:
        """Whether every constraint has room for one more (each against its own limit)."""
        return all(self.active(c.resource) < c.limit for c in constraints)

    def wait(self, ticket: str, queue: str, constraints: Sequence[Constraint]) -> None:
        """Index a waiter under each resource it needs (keeping its arrival if it has one)."""
        if not constraints:
            return
        if ticket not in self.arrival:
            self.arrival[ticket] = self.next_arrival
            self.next_arrival += 1
        for c in constraints:
            self.waiting.setdefault(c.resource, {})[ticket] = queue

    def unwait(self, ticket: str) -> None:
        """Forget a waiter (granted or withdrawn)."""
        if self.arrival.pop(ticket, None) is None:
            return
        for resource in [r for r, tickets in self.waiting.items() if ticket in tickets]:
            del self.waiting[resource][ticket]
            if not self.waiting[resource]:
                del self.waiting[resource]

    def take(self, ticket: str, constraints: Sequence[Constraint]) -> None:
        """The ticket holds a slot of each of its resources."""
        self.unwait(ticket)
        if not constraints:
            return
        for c in constraints:
            self.held.setdefault(c.resource, set()).add(ticket)
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
        return len(self.waiting.get(resource, ()))


def grant_freed(
    queues: Mapping[str, QueueState], resources: ResourceState, freed: Iterable[str], now_ms: int
) -> list[str]:
    """Offer freed resources to their waiters, across queues: priority first, then arrival;
    a waiter is granted only if its queue has room and all its constraints fit."""
    from durable_flow.admission.policy import room, take_slot

    granted: list[str] = []
    for resource in dict.fromkeys(freed):
        if resources.active(resource) == 0 and not resources.waiting.get(resource):
            continue
        candidates = []
        for ticket, queue in resources.waiting.get(resource, {}).items():
            state = queues.get(queue)
            waiter = state.waiters.get(ticket) if state is not None else None
            if waiter is not None:
                candidates.append((-waiter.priority, resources.arrival[ticket], state, waiter))
        candidates.sort(key=lambda c: (c[0], c[1]))
        for _, _, state, waiter in candidates:
            if waiter.ticket not in state.waiters:
                continue
            available = room(state, now_ms)
            if (available is None or available > 0) and resources.fits(waiter.constraints):
                take_slot(state, waiter, now_ms)
                resources.take(waiter.ticket, waiter.constraints)
                granted.append(waiter.ticket)
    return granted


def top_usage(counts: dict[str, tuple[int, int]], limit: int) -> list[ResourceUsage]:
    """The `limit` busiest of `counts` (resource -> (active, waiting)): most active, then most
    waiting, then by name; resources with neither are left out."""
    ranked = sorted(
        (item for item in counts.items() if item[1][0] or item[1][1]), key=lambda i: (-i[1][0], -i[1][1], i[0])
    )
    return [ResourceUsage(resource, active, waiting) for resource, (active, waiting) in ranked[:limit]]
