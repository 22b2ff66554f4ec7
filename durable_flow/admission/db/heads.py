"""The `db` backend's index of key heads: per resource and key (a waiter's other resource, or
`SOLO`), one `AdmissionResourceHead` row naming the key's first waiter by priority then arrival,
with the key's last serve, so a freed resource ranks its keys by reading their heads (the
`df_rhead_rank` index) instead of its whole line: the rows `resource_line` keeps in memory for
`local`, and the `heads` zset `resources.lua` keeps for `redis`.

A head is refreshed (one indexed read of the key's first waiter and one upsert) whenever a waiter
joins or leaves, and its `served` is moved on (one indexed UPDATE by `df_rhead_other`) whenever
its key is served, so a head row's rank is always current. Everything runs in the caller's
transaction.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Q, QuerySet, Subquery

from durable_flow.admission.rules.resource_line import NEVER_SERVED, SOLO
from durable_flow.models import AdmissionResourceHead, AdmissionResourceServed, AdmissionResourceWaiter

#: A head's rank: (-priority, the key's last serve, arrival); smaller ranks first.
Rank = tuple[int, int, int]


def served_of(resource: str, key: str) -> int:
    """When `key` of `resource`'s line was last served: the key's `served`, or for `SOLO` the
    resource's `solo` (NEVER_SERVED: never)."""
    value = _served_rows(resource, key).first()
    return NEVER_SERVED if value is None else value


def _served_rows(resource: str, key: str) -> QuerySet[AdmissionResourceServed, int]:
    """The one value `served_of` reads, as a query (also a subquery of `refresh`'s read)."""
    if key == SOLO:
        return AdmissionResourceServed.objects.filter(resource=resource).values_list("solo", flat=True)
    return AdmissionResourceServed.objects.filter(resource=key).values_list("served", flat=True)


def refresh(pairs: Iterable[tuple[str, str]]) -> None:
    """Point each (resource, key) head at the key's first waiter, or drop it when none waits."""
    for resource, key in set(pairs):
        first = (
            AdmissionResourceWaiter.objects.filter(resource=resource, other=key)
            .annotate(last=Subquery(_served_rows(resource, key)[:1]))
            .order_by("-priority", "id")
            .values_list("id", "priority", "ticket", "queue", "last")
            .first()
        )
        if first is None:
            AdmissionResourceHead.objects.filter(resource=resource, other=key).delete()
            continue
        arrival, priority, ticket, queue, last = first
        AdmissionResourceHead.objects.bulk_create(
            [
                AdmissionResourceHead(
                    resource=resource,
                    other=key,
                    priority=priority,
                    served=NEVER_SERVED if last is None else last,
                    arrival=arrival,
                    ticket=ticket,
                    queue=queue,
                )
            ],
            update_conflicts=True,
            unique_fields=["resource", "other"],
            update_fields=["priority", "served", "arrival", "ticket", "queue"],
        )


def withdraw(ticket: str) -> None:
    """Delete the ticket's resource waiter rows and refresh the heads they may have been."""
    rows = AdmissionResourceWaiter.objects.filter(ticket=ticket)
    pairs = list(rows.values_list("resource", "other"))
    if pairs:
        rows.delete()
        refresh(pairs)


def served(names: list[str], number: int, alone: bool) -> None:
    """Keys `names` were just served (serve `number`): move their heads' rank on, in every line."""
    AdmissionResourceHead.objects.filter(other__in=names).update(served=number)
    if alone:
        AdmissionResourceHead.objects.filter(resource=names[0], other=SOLO).update(served=number)


def rank_of(head: AdmissionResourceHead) -> Rank:
    return (-head.priority, head.served, head.arrival)


def next_head(resource: str, after: Rank | None) -> AdmissionResourceHead | None:
    """The best head of `resource` ranked after `after` (keyset on the df_rhead_rank index)."""
    heads = AdmissionResourceHead.objects.filter(resource=resource)
    if after is not None:
        priority, last, arrival = -after[0], after[1], after[2]
        heads = heads.filter(
            Q(priority__lt=priority)
            | Q(priority=priority, served__gt=last)
            | Q(priority=priority, served=last, arrival__gt=arrival)
        )
    return heads.order_by("-priority", "served", "arrival").first()


def next_in_key(resource: str, key: str, priority: int, arrival: int) -> AdmissionResourceWaiter | None:
    """The key's next waiter after the one at (priority, arrival) (the df_rwaiter_key index)."""
    return (
        AdmissionResourceWaiter.objects.filter(resource=resource, other=key)
        .filter(Q(priority__lt=priority) | Q(priority=priority, id__gt=arrival))
        .order_by("-priority", "id")
        .first()
    )
