"""The admission interface: every backend (`local`, `db`, `redis`) is a class of this shape.

Admission sits between the engine and every transport: before a queued step is dispatched,
the engine asks `try_admit`; the slot it gets is given back with `release` when the step's
result lands. A backend must pass `durable_flow.testing.admission_contract`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

from durable_flow.options import Configurable, Option, positive_int
from durable_flow.queues import QueueConfig

Clock = Callable[[], int]
"""Epoch milliseconds. Injected so decision logic can be tested without sleeping."""

BlockReason = Literal["rate_limited", "concurrency", "waiting_turn"]


def system_clock_ms() -> int:
    """Wall-clock epoch milliseconds."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """One call asking for a slot. `ticket` names it (`run_id/step_key`) across retries,
    so a call that re-asks keeps its place in line."""

    queue: str
    ticket: str
    priority: int = 0
    fairness_key: str = ""

    @property
    def key(self) -> str:
        """The fairness bucket; defaults to the run id so unrelated runs are fair to each other."""
        return self.fairness_key or self.ticket.rsplit("/", 1)[0]


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """The answer to `try_admit`: admitted, or blocked until `retry_at_ms` (epoch ms)."""

    admitted: bool
    retry_at_ms: int | None = None
    reason: BlockReason | None = None

    @classmethod
    def admit(cls) -> AdmissionDecision:
        return cls(admitted=True)

    @classmethod
    def block(cls, retry_at_ms: int, reason: BlockReason) -> AdmissionDecision:
        return cls(admitted=False, retry_at_ms=retry_at_ms, reason=reason)


FreedCallback = Callable[[str], None]


DEFAULT_WAITER_TTL_MS = 60_000

WAITER_TTL_OPTION = Option("How long (ms) a blocked call keeps its place in line without asking again.", positive_int)


class AdmissionBackend(Configurable, ABC):
    """Where admission accounting happens. Implementations must be thread-safe.

    Subclasses implement the four core methods; the optional ones have working defaults
    (documented on each), so the engine calls them unconditionally.
    """

    SETTING: ClassVar[str] = 'DURABLE_FLOW["ADMISSION"]'
    OPTIONS: ClassVar[Mapping[str, Option]] = {"WAITER_TTL_MS": WAITER_TTL_OPTION}

    @abstractmethod
    def register(self, config: QueueConfig) -> None:
        """Add or replace a queue's config."""

    @abstractmethod
    def handles(self, queue: str) -> bool:
        """Whether calls naming `queue` are gated (a queue never registered is not)."""

    @abstractmethod
    def try_admit(self, request: AdmissionRequest) -> AdmissionDecision:
        """Take a slot for `request.ticket`, or register it as a waiter and say when to retry.

        Asking again with a ticket that already holds a slot answers admitted and takes no
        second slot, so an engine that crashed between admission and checkpoint is safe.
        """

    @abstractmethod
    def release(self, queue: str, ticket: str) -> None:
        """Give back the ticket's slot (if held) and forget it as a waiter. Idempotent."""

    # -- optional, with defaults -------------------------------------------------------------
    def on_freed(self, callback: FreedCallback) -> None:
        """Call `callback(queue)` when a slot frees, so blocked runs retry early. Default:
        never called, and blocked runs wait for the poller's tick."""

    def adopt(self, queue: str, ticket: str) -> bool:
        """The executing process takes over the ticket's slot; False if the slot was reclaimed
        meanwhile (the step then goes back through admission). Default: True, for backends
        whose slots do not belong to a live process (`local`, `db`)."""
        return True

    # -- read model (the dashboard and the admin ask these, whatever the backend) ----------
    def in_flight(self, queue: str) -> int | None:
        """Slots held on `queue` now; None (the default) when the backend cannot tell."""
        return None

    def waiting(self, queue: str) -> int | None:
        """Blocked calls registered as waiters on `queue` (a waiter that gave up counts until
        its TTL lapses); None (the default) when the backend cannot tell."""
        return None

    def window_usage(self, queue: str) -> int | None:
        """Admissions counted in `queue`'s current rate window; None when the queue has no
        rate limit, is unknown, or (the default) the backend cannot tell."""
        return None

    def next_waiters(self, queue: str, limit: int) -> list[str] | None:
        """The tickets admission would pick next on `queue`, best first, or None when the
        backend cannot tell (the engine then wakes the best-placed waiting checkpoints)."""
        return None


class FreedAnnouncer:
    """`on_freed` for backends that learn of a release in-process (`local`, `db`); put it
    before `AdmissionBackend` in the bases so its `on_freed` wins."""

    def __init__(self) -> None:
        self._freed_callbacks: list[FreedCallback] = []

    def on_freed(self, callback: FreedCallback) -> None:
        """Call `callback(queue)` after each release on this instance."""
        self._freed_callbacks.append(callback)

    def announce_freed(self, queue: str) -> None:
        for callback in list(self._freed_callbacks):
            callback(queue)
