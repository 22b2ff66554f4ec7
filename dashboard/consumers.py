"""The live feed: staff clients get a snapshot every second over a WebSocket."""

from __future__ import annotations

import asyncio
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from dashboard.snapshot import snapshot


class LiveConsumer(AsyncJsonWebsocketConsumer):
    """Closes anonymous and non-staff connections; pushes `snapshot()` every second."""

    interval_s = 1.0

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=4403)
            return
        await self.accept()
        self._task = asyncio.create_task(self._push())

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "_task", None)
        if task is not None:
            task.cancel()

    async def _push(self) -> None:
        while True:
            data: dict[str, Any] = await database_sync_to_async(snapshot)()
            await self.send_json(data)
            await asyncio.sleep(self.interval_s)


class FlowConsumer(AsyncJsonWebsocketConsumer):
    """The flow view's feed: where each call of one queue is, twice a second (staff only)."""

    interval_s = 0.5

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=4403)
            return
        from urllib.parse import parse_qs

        from dashboard.flow import burst_config

        query = parse_qs(self.scope.get("query_string", b"").decode())
        self.queue = (query.get("queue") or [burst_config()["QUEUE"]])[0][:100]
        await self.accept()
        self._task = asyncio.create_task(self._push())

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "_task", None)
        if task is not None:
            task.cancel()

    async def _push(self) -> None:
        from dashboard.flow import flow_snapshot

        while True:
            data: dict[str, Any] = await database_sync_to_async(flow_snapshot)(self.queue)
            await self.send_json(data)
            await asyncio.sleep(self.interval_s)
