"""Queue configs written to `FlowQueue`, where every process and the admin read them.

Apart from `queues`, which parses and validates a config before the app registry exists (the
settings build them): writing one needs the models.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError

from durable_flow.config.queues import QueueConfig, queue_from_dict
from durable_flow.config.settings import get_settings
from durable_flow.models import FlowQueue


def write_queues(queues: Iterable[QueueConfig], using: str = "default") -> None:
    """Upsert queue configs into `FlowQueue`, where every process and the admin read them."""
    for config in queues:
        FlowQueue.objects.using(using).update_or_create(name=config.name, defaults={"config": config.as_dict()})


def stored_queue(name: str) -> QueueConfig | None:
    """A queue's config as written to `FlowQueue` (None: never registered, or unreadable)."""
    raw = FlowQueue.objects.filter(pk=name).values_list("config", flat=True).first()
    if not raw:
        return None
    try:
        return queue_from_dict(raw)
    except (ValueError, TypeError):  # a config this code cannot read (InvalidQueueConfig is a ValueError)
        return None


def persist_configured_queues(sender: Any = None, **kwargs: Any) -> None:
    """post_migrate handler: make the settings' queues visible in the admin at once."""
    try:
        write_queues(get_settings().queues, using=kwargs.get("using", "default"))
    except DatabaseError:  # the table may not exist yet when migrating backwards
        logging.getLogger("durable_flow.engine").debug("could not persist queues", exc_info=True)
