"""psycopg dumpers for the app's `TextChoices`, registered on every PostgreSQL connection.

The ORM sends a `TextChoices` member (`RunStatus.RUNNING`) as it is, and psycopg finds no dumper
registered for its class: every time it walks the class's MRO, raising and catching a `KeyError`
and building a dotted name at each step, until it reaches `str`, and it does not remember the
answer. A run's status, a checkpoint's kind and status, an attempt's status and a task's kind
are on every step's statements, so that walk is a visible share of a worker's CPU (see
docs/benchmark-history.md). Registering `str`'s own dumpers for these classes makes it a dict
lookup; the values sent are the same (the members are `str`s, dumped as `str` is).
"""

from __future__ import annotations

from typing import Any

from durable_flow.models import AttemptStatus, RunStatus, StepKind, StepStatus, TaskKind

#: Every `TextChoices` class the app's models store.
CHOICES: tuple[type[str], ...] = (RunStatus, StepKind, StepStatus, TaskKind, AttemptStatus)


def register_choice_dumpers(sender: Any, connection: Any, **kwargs: Any) -> None:
    """`connection_created` receiver: on PostgreSQL (psycopg 3), dump `CHOICES` as `str`."""
    if connection.vendor != "postgresql" or not hasattr(connection.connection, "adapters"):
        return  # SQLite, or psycopg2 (which adapts str subclasses with str's adapter already)
    from psycopg.adapt import PyFormat

    adapters = connection.connection.adapters  # this connection's own map (copied on write)
    # AUTO last: registering a dumper also makes it its class's AUTO one, and `str`'s AUTO
    # dumper is the one the ORM's values get with server-side binding.
    for fmt in (PyFormat.BINARY, PyFormat.TEXT, PyFormat.AUTO):
        dumper = adapters.get_dumper(str, fmt)
        for choices in CHOICES:
            adapters.register_dumper(choices, dumper)
