"""The inline transport: runs turns and steps in this process, right after the enqueueing
transaction commits. For unit tests and scripts; no worker needed."""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

from django.db import transaction

from durable_flow.transports.base import Transport

if TYPE_CHECKING:
    from durable_flow.engine import Engine


class InlineTransport(Transport):
    """Work queued on a per-thread deque and drained on commit, depth-first free (no recursion)."""

    name = "inline"

    def __init__(self) -> None:
        self._local = threading.local()
        self._engine: Engine | None = None

    def bind(self, engine: Engine) -> None:
        self._engine = engine

    def _queue(self) -> deque[tuple[str, tuple[object, ...]]]:
        queue = getattr(self._local, "queue", None)
        if queue is None:
            queue = self._local.queue = deque()
        return queue

    def enqueue_turn(self, run_id: str) -> None:
        self._queue().append(("turn", (run_id,)))
        transaction.on_commit(self.drain)

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        self._queue().append(("step", (run_id, step_key, attempt)))
        transaction.on_commit(self.drain)

    def drain(self) -> None:
        """Run everything queued in this thread until nothing is left."""
        if getattr(self._local, "draining", False) or self._engine is None:
            return
        self._local.draining = True
        try:
            queue = self._queue()
            while queue:
                kind, args = queue.popleft()
                if kind == "turn":
                    self._engine.run_turn(*args)  # type: ignore[arg-type]
                else:
                    self._engine.execute_step(*args, worker_id="inline")  # type: ignore[arg-type]
        finally:
            self._local.draining = False
