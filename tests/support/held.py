"""Transports that keep what the engine sends for the test to run or look at: `HeldTransport`
(the `held` fixture) runs turns on commit and holds step attempts until the test runs them one by
one; `QueuedTurns` (the `queued_turns` fixture) keeps turns and steps and runs nothing. Also the
input of the `tests.queued` workflows."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from django.db import transaction

from durable_flow.engine import Engine
from durable_flow.transports.base import Transport
from tests.conftest import MovableClock, local_engine


class HeldTransport(Transport):
    """Turns run on commit; step attempts wait in `held` until `run_step` executes one."""

    name = "held"

    def __init__(self) -> None:
        self.held: deque[tuple[str, str, int, int]] = deque()
        self.turns: deque[str] = deque()
        self.engine: Engine | None = None

    def bind(self, engine: Engine) -> None:
        self.engine = engine

    def enqueue_turn(self, run_id: str) -> None:
        self.turns.append(run_id)
        transaction.on_commit(self.drain_turns)

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        self.held.append((run_id, step_key, attempt, priority))

    def drain_turns(self) -> None:
        """Run the queued turns now (they also run on commit)."""
        assert self.engine is not None
        while self.turns:
            self.engine.run_turn(self.turns.popleft())

    def run_step(self, index: int = 0) -> tuple[str, str, int, int]:
        """Execute one held step attempt (by position) and let the engine record it."""
        assert self.engine is not None
        item = self.held[index]
        del self.held[index]
        self.engine.execute_step(item[0], item[1], item[2], worker_id="test")
        self.drain_turns()
        return item

    def held_runs(self) -> list[str]:
        return [item[0] for item in self.held]


@pytest.fixture
def held(clock: MovableClock, transactional_db: None) -> tuple[Engine, HeldTransport]:
    transport = HeldTransport()
    return local_engine(clock, transport), transport


def queued(queue: str, value: Any, **hints: Any) -> dict[str, Any]:
    return {"queue": queue, "value": value, **hints}


class QueuedTurns(Transport):
    """Keeps turns and steps as they are sent, for the test to look at (nothing runs them)."""

    name = "queued-turns"

    def __init__(self) -> None:
        self.turns: deque[str] = deque()
        self.steps: deque[tuple[str, str, int]] = deque()

    def enqueue_turn(self, run_id: str) -> None:
        self.turns.append(run_id)

    def enqueue_step(self, run_id: str, step_key: str, attempt: int, priority: int) -> None:
        self.steps.append((run_id, step_key, attempt))


@pytest.fixture
def queued_turns(clock: MovableClock, transactional_db: None) -> tuple[Engine, QueuedTurns]:
    transport = QueuedTurns()
    return local_engine(clock, transport), transport
