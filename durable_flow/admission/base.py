"""The admission interface: every backend (`local`, `db`, `redis`) is a class of this shape.

Admission sits between the engine and every transport. Before a queued step is dispatched the
engine asks `try_admit`: the call takes a slot, or joins the queue's waiting line and parks at
no cost. Whenever there is room (a `release`, a rate window reopening, another call's
decision) the backend *grants* it to the rightful next waiters in the same atomic operation
and returns their tickets; the engine dispatches each from its `waiting` checkpoint. Just
before a granted step runs, `try_start` counts it in the queue's rate window, so a rate limit
holds where the provider counts: at the step's start. A backend must pass
`durable_flow.testing.admission_contract`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple

from durable_flow.config.limits import TICKET_SEPARATOR, ticket_text
from durable_flow.config.options import Configurable, Option
from durable_flow.config.queues import QueueConfig
from durable_flow.definitions.step_concurrency import Constraint

Clock = Callable[[], int]
"""Epoch milliseconds. Injected so decision logic can be tested without sleeping."""

OnCount = Callable[[], object] | None
"""Called by `try_start` just before it reads the clock a start is counted at."""

BlockReason = Literal["rate_limited", "concurrency", "step_concurrency", "waiting_turn"]


def system_clock_ms() -> int:
    """Wall-clock epoch milliseconds."""
    return time.time_ns() // 1_000_000


class Ticket(NamedTuple):
    """Names one step call across its retries: `<run_id>/<step key>` (run ids may contain
    `/`; step keys never do)."""

    run_id: str
    key: str

    def __str__(self) -> str:
        return ticket_text(self.run_id, self.key)

    @classmethod
    def parse(cls, ticket: str) -> Ticket:
        run_id, _, key = ticket.rpartition(TICKET_SEPARATOR)
        return cls(run_id, key)


@dataclass(frozen=True, slots=True)
class ResourceUsage:
    """One step-concurrency resource (a constraint's evaluated key) as the dashboard shows it."""

    resource: str
    active: int
    waiting: int


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """One call asking for a slot. `ticket` names it (`run_id/step_key`) across retries,
    so a call that re-asks keeps its place in line.

    `constraints` (its run's step concurrency) gate the call whatever its queue: admitted only
    when the queue (if registered) admits it and every constraint has room, taking all its
    slots or none. A call with constraints and no registered queue (`queue=""` included) is
    gated by its constraints alone, on the backend's pseudo-queue `""`."""

    queue: str
    ticket: str
    priority: int = 0
    fairness_key: str = ""
    constraints: tuple[Constraint, ...] = ()

    @property
    def key(self) -> str:
        """The fairness bucket; defaults to the run id so unrelated runs are fair to each other."""
        return self.fairness_key or Ticket.parse(self.ticket).run_id


@dataclass(frozen=True, slots=True)
class Grant:
    """Slots handed to waiters in one atomic operation: their tickets, best first, and when a
    rate window reopens for the waiters it still holds back (epoch ms; None when no waiter is
    held back by the window alone)."""

    tickets: tuple[str, ...] = ()
    retry_at_ms: int | None = None


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """The answer to `try_admit`: admitted, or parked as a waiter. `retry_at_ms` (epoch ms) is
    when the blocking condition may lift (the window reopening, for `rate_limited`);
    `granted` are *other* waiters this decision handed a slot to, for the engine to dispatch.

    For a blocked call, what the backend knew when it decided, so the engine can record why the
    call waits: `limits`, the queue's config it decided with (None when the backend does not
    say), and `full`, the step-concurrency constraint that had no room (for `step_concurrency`).
    Neither takes part in comparing decisions: backends that agree on the decision agree, whether
    or not they say these (the contract kit compares decisions)."""

    admitted: bool
    retry_at_ms: int | None = None
    reason: BlockReason | None = None
    granted: tuple[str, ...] = ()
    limits: QueueConfig | None = field(default=None, compare=False)
    full: Constraint | None = field(default=None, compare=False)

    @classmethod
    def admit(cls, granted: tuple[str, ...] = ()) -> AdmissionDecision:
        return cls(admitted=True, granted=granted)

    @classmethod
    def block(
        cls,
        retry_at_ms: int,
        reason: BlockReason,
        granted: tuple[str, ...] = (),
        limits: QueueConfig | None = None,
        full: Constraint | None = None,
    ) -> AdmissionDecision:
        return cls(admitted=False, retry_at_ms=retry_at_ms, reason=reason, granted=granted, limits=limits, full=full)


def first_full(constraints: Sequence[Constraint], active: Callable[[str], int]) -> Constraint | None:
    """The first of `constraints` with no room (`active(resource)` slots held), or None."""
    return next((c for c in constraints if active(c.resource) >= c.limit), None)


class AdmissionBackend(Configurable, ABC):
    """Where admission accounting happens. Implementations must be thread-safe.

    Subclasses implement the seven abstract methods (`register`, `handles`, `try_admit`,
    `release`, `grant`, `reoffer`, `try_start`); the optional ones have working defaults
    (documented on each), so the engine calls them unconditionally.
    """

    SETTING: ClassVar[str] = 'DURABLE_FLOW["ADMISSION"]'
    OPTIONS: ClassVar[Mapping[str, Option]] = {}
    #: Whether `AdmissionRequest.constraints` are enforced. A backend that cannot must say so:
    #: the engine then refuses to start runs that declare step concurrency.
    SUPPORTS_CONSTRAINTS: ClassVar[bool] = False
    #: Whether the accounting lives in the engine's database, so a release is written by the
    #: transaction that settles the step (exact: both or neither). A backend whose state lives
    #: elsewhere (`redis`) says False: the engine then releases after that transaction commits,
    #: so an outage of the backend cannot roll a step's result back, and the poller's
    #: maintenance frees a slot whose release failed (`held_tickets`).
    RELEASES_IN_TRANSACTION: ClassVar[bool] = True
    #: Whether a slot belongs to a live process, so the one executing its step must take it
    #: over first (`adopt`, which may find it reclaimed). False where `adopt` is always True.
    #: True also lets a settled step's slot go back before its result commits (a result that
    #: fails to commit finds its slot gone at its retry: `engine/release_order.py`).
    SLOTS_ADOPTED: ClassVar[bool] = False

    @classmethod
    def declaration_problems(cls, options: Mapping[str, object], definitions: Collection[object]) -> list[str]:
        """What in these options and the registered workflows (`definitions`) the backend could
        not keep, one message each (`manage.py check`: `durable_flow.E030`); checked without
        building the backend. Default: nothing."""
        return []

    @abstractmethod
    def register(self, config: QueueConfig) -> None:
        """Add or replace a queue's config."""

    @abstractmethod
    def handles(self, queue: str) -> bool:
        """Whether calls naming `queue` are gated (a queue never registered is not)."""

    @abstractmethod
    def try_admit(self, request: AdmissionRequest) -> AdmissionDecision:
        """Take a slot for `request.ticket`, or register it as a waiter (keeping the place in
        line it already has) and grant whatever room there is to the waiters ahead of it.

        Asking again with a ticket that already holds a slot answers admitted and takes no
        second slot, so an engine that crashed between admission and checkpoint is safe.
        """

    @abstractmethod
    def release(self, queue: str, ticket: str, *, grant_next: bool = True) -> Grant:
        """Give back the ticket's slot (if held) and its constraints' slots, forget it as a
        waiter, and (unless `grant_next` is False: a paused queue) grant the room to the next
        waiters in the same atomic operation: the queue's, and those of any queue that wait
        for a freed constraint (best first, skipping those another gate still blocks).
        Idempotent."""

    @abstractmethod
    def grant(self, queue: str) -> Grant:
        """Grant every slot there is room for now to the rightful next waiters (called when
        a rate window reopens, on resume and resize, and by the poller as a safety net)."""

    @abstractmethod
    def reoffer(self, queue: str, requests: Sequence[AdmissionRequest]) -> list[str]:
        """The safety net for grants lost in a crash: return the tickets among `requests` that
        hold a slot already, and register the others as waiters if they are not (keeping the
        place of those that are). Decides nothing; `grant` follows."""

    @abstractmethod
    def try_start(self, queue: str, ticket: str, key: str = "", *, on_count: OnCount = None) -> int:
        """A granted step is about to run: count its start in the queue's rate window (on the
        backend's clock), or return how many ms to wait until the window has room. 0 means
        started (always, for a queue without a rate limit). `key` is the call's fairness key
        (default: the ticket's run id), for a per-key window or throttle.

        `on_count` is called right before the backend reads the clock it counts at, after any
        lock it waited for: the caller's clock at that moment is a lower bound of the count's
        instant, so a wait for the lock does not make the call look late (`await_start`)."""

    # -- optional, with defaults -------------------------------------------------------------
    #: Where the backend learns which queues are paused (`watch_pauses`); none until told.
    _paused_source: Callable[[], Collection[str]] | None = None

    def watch_pauses(self, paused: Callable[[], Collection[str]]) -> None:
        """Give the backend the names of the paused queues, asked whenever it may grant across
        queues (the engine passes its `PausedQueues.names`). A freed step-concurrency resource
        can go to a waiter of any queue: one whose queue is paused is passed over and keeps its
        place until the queue resumes (`resume_queue` grants it). A backend with no constraints
        may ignore this."""
        self._paused_source = paused

    def paused_queues(self) -> Collection[str]:
        """The paused queues' names, as `watch_pauses` reports them now (none if never told)."""
        source = self._paused_source
        return source() if source is not None else ()

    def adopt(self, queue: str, ticket: str) -> bool:
        """The executing process takes over the ticket's slot; False if the slot was reclaimed
        meanwhile (the step then goes back through admission). Default: True, for backends
        whose slots do not belong to a live process (`local`, `db`)."""
        return True

    def held_tickets(self, queue: str) -> list[str] | None:
        """The tickets holding a slot of `queue` now (bounded by its concurrency), for the
        repair of slots whose release was lost; None (the default) for a backend that releases
        in the settling transaction, which cannot lose one."""
        return None

    # -- read model (the dashboard and the admin ask these, whatever the backend) ----------
    def in_flight(self, queue: str) -> int | None:
        """Slots held on `queue` now; None (the default) when the backend cannot tell."""
        return None

    def waiting(self, queue: str, limit: int | None = None) -> int | None:
        """Calls parked as waiters on `queue`, counted up to `limit` when the backend's count
        reads its line (None: all); None (the default) when the backend cannot tell."""
        return None

    def window_usage(self, queue: str) -> int | None:
        """Step starts counted in `queue`'s current rate window; None when the queue has no
        rate limit, is unknown, or (the default) the backend cannot tell."""
        return None

    def key_window_usage(self, queue: str, limit: int) -> list[tuple[str, int]] | None:
        """The busiest fairness keys of a per-key window: (key, step starts in its current
        window), most first, at most `limit`; None without a per-key window or (the default)
        when the backend cannot tell."""
        return None

    def throttle_usage(self, queue: str, limit: int) -> list[tuple[str, float]] | None:
        """The throttle's busiest buckets on the step-start side (where the provider counts):
        (fairness key, or "" for a queue-wide throttle; how far its TAT runs ahead of now, in
        ms), furthest first, at most `limit`, idle buckets left out; None without a throttle
        or (the default) when the backend cannot tell."""
        return None

    def next_waiters(self, queue: str, limit: int) -> list[str] | None:
        """The tickets admission would grant next on `queue`, best first (for the dashboard),
        or None when the backend cannot tell."""
        return None

    def constraint_usage(self, prefix: str = "", limit: int = 10) -> list[ResourceUsage] | None:
        """The busiest step-concurrency resources whose name starts with `prefix` (a
        constraint's, e.g. `sc:fn:<workflow>:`), most active first, then most waiting; at most
        `limit`. None (the default) when the backend cannot tell."""
        return None
