"""The live feed: `/ws/live/?topic=<page>`. Staff only; each tab joins its topic's group and
forwards the ticks the broadcaster sends (`dashboard/live.py`), so nothing is computed per tab."""

from __future__ import annotations

import time
from importlib import import_module
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import SESSION_KEY

from dashboard.live import broadcaster, group_name, parse_topic

#: Close codes the page's script understands.
FORBIDDEN, BAD_TOPIC, SESSION_EXPIRED = 4403, 4400, 4401


def session_alive(session_key: str | None, user_pk: Any) -> bool:
    """Whether the session this socket opened with still logs in the same user (not expired,
    not logged out)."""
    if not session_key:
        return False
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    return store.load().get(SESSION_KEY) == str(user_pk)


class LiveConsumer(AsyncJsonWebsocketConsumer):
    """Closes anonymous and non-staff connections (4403) and unknown topics (4400); every
    `session_check_s` re-checks the session and closes with 4401 once it has expired."""

    session_check_s = 30.0

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=FORBIDDEN)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("utf-8", "replace"))
        topic = (query.get("topic") or ["overview"])[0]
        if parse_topic(topic) is None:
            await self.close(code=BAD_TOPIC)
            return
        self.topic = topic
        await self.channel_layer.group_add(group_name(topic), self.channel_name)
        await self.accept()
        self._checked = time.monotonic()
        broadcaster.subscribe(topic)

    async def disconnect(self, code: int) -> None:
        topic = getattr(self, "topic", None)
        if topic is not None:
            broadcaster.unsubscribe(topic)
            await self.channel_layer.group_discard(group_name(topic), self.channel_name)

    async def dashboard_tick(self, event: dict[str, Any]) -> None:
        if time.monotonic() - self._checked >= self.session_check_s:
            self._checked = time.monotonic()
            session = self.scope.get("session")
            key = getattr(session, "session_key", None)
            if not await database_sync_to_async(session_alive)(key, self.scope["user"].pk):
                await self.send_json({"session": "expired"})
                await self.close(code=SESSION_EXPIRED)
                return
        await self.send_json(event["data"])
