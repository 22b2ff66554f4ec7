"""The live feed's broadcaster: one snapshot per tick, computed once in this process and sent
to every open tab through Channels groups, one group per topic (a page: `overview`, `queues`,
`queue:<name>`, `workers`, and whatever pages register with `register_topic`).

A tab subscribes by opening `/ws/live/?topic=<topic>`. While any tab of this process is open,
the broadcaster ticks every `interval_s`: it computes `snapshot()` once, renders each
subscribed topic's fragments once, and `group_send`s them; each tab then only forwards the
message. Group names carry this process's token, so with several web processes on a shared
channel layer each process feeds its own tabs (one computation per process and tick, never
one per tab) and no tab gets a tick twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from durable_flow.config.validation import storable_text
from durable_flow.exceptions import InvalidInput
from durable_flow.observe.queues import queue_flow

from . import pages
from .flow import burst_config
from .limit_pages import keys_topic, quotas_topic
from .snapshot import snapshot

logger = logging.getLogger("dashboard.live")

PROCESS_TOKEN = uuid.uuid4().hex[:12]

#: topic kind → fragments(snapshot, argument); None when the topic's object is gone.
Renderer = Callable[[Mapping[str, Any], str], "dict[str, str] | None"]
TOPICS: dict[str, Renderer] = {}


def register_topic(kind: str, render: Renderer) -> None:
    """Make `?topic=<kind>` or `?topic=<kind>:<argument>` a live topic rendered by `render`."""
    TOPICS[kind] = render


def parse_topic(raw: str) -> tuple[str, str] | None:
    """`queue:emails` → ("queue", "emails"); None for an unknown kind, an over-long topic or one
    the database cannot take (a NUL: `flow:<queue>` looks its queue up on every tick)."""
    kind, _, argument = raw.partition(":")
    if kind not in TOPICS:
        return None
    try:
        storable_text(raw, "topic", 400)
    except InvalidInput:
        return None
    return kind, argument


def group_name(topic: str) -> str:
    """A valid Channels group name (ASCII, under 100 characters) for any topic string."""
    return f"dfdash.{PROCESS_TOKEN}.{hashlib.sha1(topic.encode()).hexdigest()[:20]}"


def render_topic(snap: Mapping[str, Any], topic: str) -> dict[str, str] | None:
    parsed = parse_topic(topic)
    if parsed is None:
        return None
    kind, argument = parsed
    return TOPICS[kind](snap, argument)


def compute_tick(topics: list[str]) -> dict[str, dict[str, Any]]:
    """One message per topic, from a single snapshot."""
    snap = snapshot()
    messages = {}
    for topic in topics:
        try:
            rendered = render_topic(snap, topic)
        except Exception:
            logger.exception("rendering live topic %r failed", topic)
            continue
        messages[topic] = {**snap, "topic": topic, "fragments": rendered or {}, "gone": rendered is None}
    return messages


class Broadcaster:
    """Ticks while this process has subscribers; `computed` counts snapshots (for tests)."""

    interval_s = 1.0

    def __init__(self) -> None:
        self.subscribers: Counter[str] = Counter()
        self.computed = 0
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    def subscribe(self, topic: str) -> None:
        self.subscribers[topic] += 1
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        elif self.subscribers[topic] == 1 and self._wake is not None:
            self._wake.set()  # a new topic gets its first tick now, not a second later

    def unsubscribe(self, topic: str) -> None:
        self.subscribers[topic] -= 1
        if self.subscribers[topic] <= 0:
            del self.subscribers[topic]

    async def _run(self) -> None:
        layer = get_channel_layer()
        loop = asyncio.get_running_loop()
        while self.subscribers:
            started = loop.time()
            try:
                messages = await database_sync_to_async(compute_tick)(list(self.subscribers))
                self.computed += 1
                for topic, message in messages.items():
                    await layer.group_send(group_name(topic), {"type": "dashboard.tick", "data": message})
            except Exception:
                logger.exception("live dashboard tick failed; trying again next tick")
            wake = self._wake
            if wake is None:
                return
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), max(0.05, self.interval_s - (loop.time() - started)))
            except TimeoutError:
                pass


broadcaster = Broadcaster()


def _overview(snap: Mapping[str, Any], _: str) -> dict[str, str]:
    return pages.fragments(pages.OVERVIEW_FRAGMENTS, pages.overview_context(snap))


def _queues(snap: Mapping[str, Any], _: str) -> dict[str, str]:
    return pages.fragments(pages.QUEUES_FRAGMENTS, pages.queues_context(snap))


def _queue(snap: Mapping[str, Any], name: str) -> dict[str, str] | None:
    context = pages.queue_context(snap, name)
    return None if context is None else pages.fragments(pages.QUEUE_FRAGMENTS, context)


def _workers(snap: Mapping[str, Any], _: str) -> dict[str, str]:
    return pages.fragments(["worker-cards"], pages.workers_context(snap))


register_topic("overview", _overview)
register_topic("queues", _queues)
register_topic("queue", _queue)
register_topic("workers", _workers)
register_topic("quotas", quotas_topic)
register_topic("keys", keys_topic)


def _flow(snap: Mapping[str, Any], queue: str) -> dict[str, str]:
    """The flow view (`flow:<queue>`): where each call of the queue is, as JSON the page's
    script turns into moving dots."""
    import json

    return {"flow-data": json.dumps(queue_flow(queue or burst_config()["QUEUE"]))}


register_topic("flow", _flow)
