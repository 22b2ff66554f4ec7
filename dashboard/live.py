"""The live feed's broadcaster: one snapshot per tick, computed once in this process and sent
to every open tab through Channels groups, one group per topic (a page: `overview`, `queues`,
`queue:<name>`, `workers`, `flow:<queue>`, `runs:<query>`, and whatever pages register with
`register_topic`).

A tab subscribes by opening `/ws/live/?topic=<topic>`. While any tab of this process is open,
the broadcaster ticks every `interval_s`: it computes `snapshot()` once (when a subscribed
topic reads it), renders each subscribed topic's fragments once, and `group_send`s to each
topic's group only the fragments whose content changed since its last tick (a tick where
nothing changed carries no fragment: the tab still learns the feed is alive, and re-checks its
session). A tab that joins a group gets the topic's latest fragments once, from memory, so
every tab of a group shows the same page without anything computed per tab. Group names carry
this process's token, so with several web processes on a shared channel layer each process
feeds its own tabs (one computation per process and tick, never one per tab) and no tab gets a
tick twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.utils import timezone

from durable_flow.config.validation import storable_text
from durable_flow.exceptions import InvalidInput
from durable_flow.observe.queues import queue_flow

from . import pages, runs_list
from .flow import burst_config
from .limit_pages import keys_topic, quotas_topic
from .snapshot import snapshot

logger = logging.getLogger("dashboard.live")

PROCESS_TOKEN = uuid.uuid4().hex[:12]
#: The longest topic a tab may name (its argument is a queue name, a run id or a list's query).
MAX_TOPIC_LENGTH = 400
#: Distinct topics one process renders per tick: each costs its own queries (a run list's
#: filter, a queue's flow), so a tab asking for one more is refused (close code 4429).
MAX_TOPICS = 200

#: topic kind → fragments(snapshot, argument); None when the topic's object is gone.
Renderer = Callable[[Mapping[str, Any], str], "dict[str, str] | None"]


@dataclass(frozen=True)
class Topic:
    """A live topic kind: how it renders, how its argument is checked and put in one canonical
    spelling (so tabs showing the same thing share a group), and whether it reads the snapshot."""

    render: Renderer
    argument: Callable[[str], str | None] | None = None
    uses_snapshot: bool = True


TOPICS: dict[str, Topic] = {}


def register_topic(
    kind: str,
    render: Renderer,
    *,
    argument: Callable[[str], str | None] | None = None,
    uses_snapshot: bool = True,
) -> None:
    """Make `?topic=<kind>` or `?topic=<kind>:<argument>` a live topic rendered by `render`.
    `argument` validates the argument and returns its canonical spelling (None: refused);
    `uses_snapshot=False` for a topic that reads only its own queries."""
    TOPICS[kind] = Topic(render, argument, uses_snapshot)


def parse_topic(raw: str) -> tuple[str, str] | None:
    """`queue:emails` → ("queue", "emails"); None for an unknown kind, an over-long topic, one
    the database cannot take (a NUL: `flow:<queue>` looks its queue up on every tick) or an
    argument its kind refuses. The argument comes back in its kind's canonical spelling."""
    kind, _, argument = raw.partition(":")
    topic = TOPICS.get(kind)
    if topic is None:
        return None
    try:
        storable_text(raw, "topic", MAX_TOPIC_LENGTH)
    except InvalidInput:
        return None
    if topic.argument is not None:
        canonical = topic.argument(argument)
        if canonical is None:
            return None
        argument = canonical
    return kind, argument


def canonical_topic(raw: str) -> str | None:
    """The topic's one spelling (`runs:status=failed&workflow=x`), or None if it is refused."""
    parsed = parse_topic(raw)
    if parsed is None:
        return None
    kind, argument = parsed
    return f"{kind}:{argument}" if argument or ":" in raw else kind


def group_name(topic: str) -> str:
    """A valid Channels group name (ASCII, under 100 characters) for any topic string."""
    return f"dfdash.{PROCESS_TOKEN}.{hashlib.sha1(topic.encode()).hexdigest()[:20]}"


def render_topic(snap: Mapping[str, Any], topic: str) -> dict[str, str] | None:
    parsed = parse_topic(topic)
    if parsed is None:
        return None
    kind, argument = parsed
    return TOPICS[kind].render(snap, argument)


def compute_tick(topics: list[str]) -> tuple[str, dict[str, dict[str, str] | None]]:
    """Every topic's fragments (None: its object is gone), from a single snapshot, taken only
    when a topic reads it; and the tick's time. A topic whose rendering fails is left out."""
    kinds = {topic.partition(":")[0] for topic in topics}
    snap = snapshot() if any(TOPICS[k].uses_snapshot for k in kinds if k in TOPICS) else {}
    rendered: dict[str, dict[str, str] | None] = {}
    for topic in topics:
        try:
            rendered[topic] = render_topic(snap, topic)
        except Exception:
            logger.exception("rendering live topic %r failed", topic)
    return snap.get("at") or timezone.now().isoformat(), rendered


class Broadcaster:
    """Ticks while this process has subscribers. Per topic it keeps the fragments its group was
    last sent (`latest`, rendered at `rendered_at`): the next tick sends only those that differ,
    and a joining tab gets them all. `computed` counts ticks and `sent_fragments` the fragments
    sent (for tests)."""

    interval_s = 1.0

    def __init__(self) -> None:
        self.subscribers: Counter[str] = Counter()
        self.latest: dict[str, dict[str, str]] = {}
        self.rendered_at: dict[str, str] = {}
        self.computed = 0
        self.sent_fragments = 0
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    def subscribe(self, topic: str) -> bool:
        """Count a tab on `topic` and make sure the broadcaster ticks; False (nothing counted)
        when this process already renders `MAX_TOPICS` other topics."""
        if topic not in self.subscribers and len(self.subscribers) >= MAX_TOPICS:
            return False
        self.subscribers[topic] += 1
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run())
        elif self.subscribers[topic] == 1 and self._wake is not None:
            self._wake.set()  # a new topic gets its first tick now, not a second later
        return True

    def unsubscribe(self, topic: str) -> None:
        self.subscribers[topic] -= 1
        if self.subscribers[topic] <= 0:
            del self.subscribers[topic]
            self.latest.pop(topic, None)  # a tab opening it later gets a whole first tick
            self.rendered_at.pop(topic, None)

    def joined(self, topic: str) -> dict[str, Any] | None:
        """What a tab that just joined `topic`'s group is sent at once: the fragments the group
        has now, and when they were rendered (None before the topic's first tick, which sends
        everything to the group)."""
        fragments = self.latest.get(topic)
        if fragments is None:
            return None
        return {"topic": topic, "at": self.rendered_at.get(topic), "fragments": dict(fragments), "gone": False}

    def changes(self, topic: str, fragments: dict[str, str] | None, at: str) -> dict[str, Any]:
        """The tick message for `topic`'s group: the fragments that differ from those it was
        last sent (all of them the first time), or `gone`."""
        if fragments is None:
            self.latest.pop(topic, None)
            self.rendered_at.pop(topic, None)
            return {"topic": topic, "at": at, "fragments": {}, "gone": True}
        last = self.latest.get(topic)
        changed = {name: html for name, html in fragments.items() if last is None or last.get(name) != html}
        self.latest[topic] = fragments
        self.rendered_at[topic] = at
        self.sent_fragments += len(changed)
        return {"topic": topic, "at": at, "fragments": changed, "gone": False}

    async def tick(self) -> None:
        """One tick: every subscribed topic rendered once, and its changes sent to its group."""
        layer = get_channel_layer()
        at, rendered = await database_sync_to_async(compute_tick)(list(self.subscribers))
        self.computed += 1
        for topic, fragments in rendered.items():
            if topic not in self.subscribers:
                continue  # its last tab left while the tick was computed
            message = self.changes(topic, fragments, at)
            await layer.group_send(group_name(topic), {"type": "dashboard.tick", "data": message})

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.subscribers:
            started = loop.time()
            try:
                await self.tick()
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


def _flow(_: Mapping[str, Any], queue: str) -> dict[str, str]:
    """The flow view (`flow:<queue>`): the gate with the queue's limits as configured now (a
    resize shows on the next tick), and where each call of the queue is, as JSON the page's
    script turns into moving dots. The JSON leaves out the read's time, so an idle queue's
    dots are not sent again every tick."""
    flow = queue_flow(queue or burst_config()["QUEUE"])
    dots = {key: value for key, value in flow.items() if key != "at"}
    return {"flow-gate": pages.fragments(["flow-gate"], {"snap": flow})["flow-gate"], "flow-data": json.dumps(dots)}


register_topic("overview", _overview)
register_topic("queues", _queues)
register_topic("queue", _queue)
register_topic("workers", _workers)
register_topic("flow", _flow, uses_snapshot=False)
register_topic("runs", runs_list.render_topic, argument=runs_list.canonical_query, uses_snapshot=False)
register_topic("quotas", quotas_topic)
register_topic("keys", keys_topic)
