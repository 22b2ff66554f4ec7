"""The live feed: `/ws/live/?topic=<page>`. Staff only; each tab joins its topic's group and
forwards the ticks the broadcaster sends (`dashboard/live.py`), so nothing is computed per tab.

Before it forwards a tick, a tab re-reads who its session logs in (Django's own `get_user`), so
a user logged out, deactivated, deleted, whose password changed or who is no longer staff gets
no further tick: the socket closes instead, with a code the page's script understands.
"""

from __future__ import annotations

from importlib import import_module
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user

from . import bulk_views, event_views, run_live, schedule_views  # noqa: F401 - register these pages' topics
from .live import broadcaster, canonical_topic, group_name

#: Close codes the page's script understands. 4401: the session no longer logs this user in
#: (logged out, expired, flushed, the password changed, the user deactivated or deleted): log
#: in again. 4403: signed in, but not staff. 4400: no such live topic. 4429: this server
#: already renders as many distinct topics as it will (`live.MAX_TOPICS`).
BAD_TOPIC, SESSION_EXPIRED, FORBIDDEN, TOO_MANY_TOPICS = 4400, 4401, 4403, 4429


class _SessionData(dict[str, Any]):
    """A session's data, as `django.contrib.auth.get_user` reads it. A socket only reads: the
    key `get_user` cycles (a hash made with a fallback SECRET_KEY) or the data it flushes (a
    hash that fails) stay as they are for the browser's next request, which makes those writes
    and sets the cookie, so a check here never logs the browser out behind its back."""

    def cycle_key(self) -> None:
        pass

    def flush(self) -> None:
        self.clear()


def session_user(session_key: str | None) -> Any:
    """Who the session logs in now (`AnonymousUser` if nobody): Django's `get_user` on a fresh
    read of the session, so its expiry, a logout, the auth hash (a changed password; with
    `SECRET_KEY_FALLBACKS`) and the backend's refusal of an inactive or deleted user all count."""
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    data = store.load() if session_key else {}
    return get_user(SimpleNamespace(session=_SessionData(data)))  # type: ignore[arg-type]


def refusal(user: Any, opened_by: Any = None) -> int | None:
    """None while `user` may watch the dashboard, else the close code that says why not.
    `opened_by`: the user the socket opened with; the session now logging in another is 4401."""
    if not user.is_authenticated or not user.is_active:
        return SESSION_EXPIRED
    if opened_by is not None and user.pk != opened_by.pk:
        return SESSION_EXPIRED
    if not user.is_staff:
        return FORBIDDEN
    return None


class LiveConsumer(AsyncJsonWebsocketConsumer):
    """Refuses the handshake of anonymous, inactive and non-staff users (HTTP 403); accepts and
    closes an unknown or invalid topic with 4400, so the page can tell it from a drop. On
    joining, the tab gets its topic's latest fragments at once (then only what changes). Before
    every tick (one a second, `broadcaster.interval_s`) it re-checks the session's user (two
    primary-key reads) and closes with 4401 or 4403 instead of forwarding it."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or refusal(user) is not None:
            await self.close(code=FORBIDDEN)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("utf-8", "replace"))
        topic = canonical_topic((query.get("topic") or ["overview"])[0])
        await self.accept()
        if topic is None:
            await self.close(code=BAD_TOPIC)
            return
        self.closing = False
        if not broadcaster.subscribe(topic):
            await self.close(code=TOO_MANY_TOPICS)
            return
        self.topic = topic
        # Joined before the latest fragments are read: a tick sent in between reaches this tab
        # too, so it never misses a change (at worst it gets one twice).
        await self.channel_layer.group_add(group_name(topic), self.channel_name)
        first = broadcaster.joined(topic)
        if first is not None:
            await self.send_json(first)

    async def disconnect(self, code: int) -> None:
        topic = getattr(self, "topic", None)
        if topic is not None:
            broadcaster.unsubscribe(topic)
            await self.channel_layer.group_discard(group_name(topic), self.channel_name)

    async def dashboard_tick(self, event: dict[str, Any]) -> None:
        if self.closing:
            return  # ticks already queued before the close was noticed
        session_key = getattr(self.scope.get("session"), "session_key", None)
        user = await database_sync_to_async(session_user)(session_key)
        code = refusal(user, opened_by=self.scope["user"])
        if code is None:
            await self.send_json(event["data"])
            return
        self.closing = True
        if code == SESSION_EXPIRED:
            await self.send_json({"session": "expired"})
        await self.close(code=code)
