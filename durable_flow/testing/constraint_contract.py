"""The step-concurrency contract: rules every backend with `SUPPORTS_CONSTRAINTS` must keep.

Subclass `StepConcurrencyContract` next to `AdmissionBackendContract` (same `make_backend`):

    class TestMyBackend(AdmissionBackendContract, StepConcurrencyContract):
        def make_backend(self, clock):
            return MyBackend(clock=clock)
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from durable_flow.admission.base import AdmissionBackend, AdmissionRequest, Constraint
from durable_flow.config.queues import QueueConfig
from durable_flow.testing.clock import FakeClock


class StepConcurrencyContract:
    """Every test names one rule of step concurrency."""

    def make_backend(self, clock: FakeClock) -> AdmissionBackend:
        raise NotImplementedError

    @pytest.fixture
    def sc_backend(self, clock: FakeClock) -> AdmissionBackend:
        backend = self.make_backend(clock)
        assert backend.SUPPORTS_CONSTRAINTS, f"{type(backend).__name__} claims no step-concurrency support"
        return backend

    @pytest.fixture
    def res(self) -> str:
        # Unique per test so backends with shared storage never see old holders.
        return f"sc:fn:wf-{uuid.uuid4().hex[:8]}"

    @staticmethod
    def sc_ask(backend: AdmissionBackend, ticket: str, *constraints: Constraint, queue: str = "", **kw: Any) -> Any:
        return backend.try_admit(AdmissionRequest(queue=queue, ticket=ticket, constraints=constraints, **kw))

    def test_a_resource_admits_up_to_its_limit(self, sc_backend: AdmissionBackend, res: str) -> None:
        c = Constraint(f"{res}:a", 2)
        assert [self.sc_ask(sc_backend, f"r{i}/1", c).admitted for i in range(3)] == [True, True, False]
        blocked = self.sc_ask(sc_backend, "r9/1", c)
        assert blocked.reason == "step_concurrency"
        # Another key of the same workflow is a different resource: its own two slots.
        other = Constraint(f"{res}:b", 2)
        assert self.sc_ask(sc_backend, "s1/1", other).admitted and self.sc_ask(sc_backend, "s2/1", other).admitted

    def test_asking_twice_with_a_held_ticket_takes_one_slot(self, sc_backend: AdmissionBackend, res: str) -> None:
        c = Constraint(res, 2)
        assert self.sc_ask(sc_backend, "a/1", c).admitted and self.sc_ask(sc_backend, "a/1", c).admitted
        assert self.sc_ask(sc_backend, "b/1", c).admitted
        assert not self.sc_ask(sc_backend, "c/1", c).admitted

    def test_release_grants_the_waiter_without_asking_again(self, sc_backend: AdmissionBackend, res: str) -> None:
        c = Constraint(res, 1)
        assert self.sc_ask(sc_backend, "a/1", c).admitted
        assert not self.sc_ask(sc_backend, "b/1", c).admitted
        assert sc_backend.release("", "a/1").tickets == ("b/1",)
        assert not self.sc_ask(sc_backend, "c/1", c).admitted  # b holds it now

    def test_two_constraints_take_all_their_slots_or_none(self, sc_backend: AdmissionBackend, res: str) -> None:
        shared, account_a = Constraint(f"{res}:openai", 3), Constraint(f"{res}:acct-a", 1)
        assert self.sc_ask(sc_backend, "a1/1", shared, account_a).admitted
        # Blocked by its account: it must not take a slot of the shared resource meanwhile.
        assert not self.sc_ask(sc_backend, "a2/1", shared, account_a).admitted
        account_b = Constraint(f"{res}:acct-b", 5)
        assert self.sc_ask(sc_backend, "b1/1", shared, account_b).admitted
        assert self.sc_ask(sc_backend, "b2/1", shared, account_b).admitted
        assert not self.sc_ask(sc_backend, "b3/1", shared, account_b).admitted  # shared full: 3

    def test_each_call_checks_the_shared_count_against_its_own_limit(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        low, high = Constraint(res, 5), Constraint(res, 50)
        assert all(self.sc_ask(sc_backend, f"a{i}/1", low).admitted for i in range(5))
        assert not self.sc_ask(sc_backend, "a5/1", low).admitted
        assert all(self.sc_ask(sc_backend, f"b{i}/1", high).admitted for i in range(10))

    def test_a_freed_slot_skips_a_waiter_blocked_by_its_other_constraint(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        shared, busy, idle = Constraint(f"{res}:s", 1), Constraint(f"{res}:busy", 1), Constraint(f"{res}:idle", 1)
        assert self.sc_ask(sc_backend, "h/1", shared).admitted
        assert self.sc_ask(sc_backend, "x/1", busy).admitted
        assert not self.sc_ask(sc_backend, "w1/1", shared, busy).admitted  # oldest, but its account is busy
        assert not self.sc_ask(sc_backend, "w2/1", shared, idle).admitted
        assert sc_backend.release("", "h/1").tickets == ("w2/1",)
        # w1 keeps waiting; it is granted once both its resources have room.
        assert sc_backend.release("", "x/1").tickets == ()
        assert sc_backend.release("", "w2/1").tickets == ("w1/1",)

    def test_waiters_of_one_resource_are_granted_oldest_first(self, sc_backend: AdmissionBackend, res: str) -> None:
        c = Constraint(res, 1)
        assert self.sc_ask(sc_backend, "h/1", c).admitted
        for i in range(4):
            assert not self.sc_ask(sc_backend, f"w{i}/1", c).admitted
        order = []
        holder = "h/1"
        for _ in range(4):
            (holder,) = sc_backend.release("", holder).tickets
            order.append(holder)
        assert order == ["w0/1", "w1/1", "w2/1", "w3/1"]

    def test_a_queue_and_a_constraint_are_decided_together(
        self, sc_backend: AdmissionBackend, res: str, clock: FakeClock
    ) -> None:
        queue = f"q-{uuid.uuid4().hex[:8]}"
        sc_backend.register(QueueConfig(name=queue, concurrency=1))
        c = Constraint(res, 1)
        assert self.sc_ask(sc_backend, "a/1", c, queue=queue).admitted
        # The queue is full: the call waits and takes no resource slot...
        assert not self.sc_ask(sc_backend, "b/1", Constraint(f"{res}:other", 1), queue=queue).admitted
        # ...and one whose queue has room but whose resource is full waits too.
        assert not self.sc_ask(sc_backend, "c/1", c).admitted
        # a's release frees both: b gets the queue slot, c the resource.
        assert set(sc_backend.release(queue, "a/1").tickets) == {"b/1", "c/1"}

    def test_a_waiter_in_another_queue_is_granted_a_freed_resource(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        q1, q2 = f"q-{uuid.uuid4().hex[:8]}", f"q-{uuid.uuid4().hex[:8]}"
        sc_backend.register(QueueConfig(name=q1, concurrency=5))
        sc_backend.register(QueueConfig(name=q2, concurrency=5))
        c = Constraint(res, 1)
        assert self.sc_ask(sc_backend, "a/1", c, queue=q1).admitted
        assert not self.sc_ask(sc_backend, "b/1", c, queue=q2).admitted
        assert sc_backend.release(q1, "a/1").tickets == ("b/1",)
        assert sc_backend.in_flight(q2) in (None, 1)

    def test_releasing_a_waiter_withdraws_it(self, sc_backend: AdmissionBackend, res: str) -> None:
        c = Constraint(res, 1)
        assert self.sc_ask(sc_backend, "a/1", c).admitted
        assert not self.sc_ask(sc_backend, "b/1", c).admitted
        sc_backend.release("", "b/1")
        assert sc_backend.release("", "a/1").tickets == ()
        assert self.sc_ask(sc_backend, "c/1", c).admitted

    def test_reoffer_restores_a_lost_waiter(self, sc_backend: AdmissionBackend, res: str) -> None:
        c = Constraint(res, 1)
        assert self.sc_ask(sc_backend, "a/1", c).admitted
        request = AdmissionRequest(queue="", ticket="b/1", constraints=(c,))
        assert sc_backend.reoffer("", [request, AdmissionRequest(queue="", ticket="a/1", constraints=(c,))]) == ["a/1"]
        assert sc_backend.release("", "a/1").tickets == ("b/1",)

    def test_a_shared_resource_goes_to_the_key_served_least_recently(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        shared = Constraint(f"{res}:openai", 1)
        acct = {k: Constraint(f"{res}:acct-{k}", 5) for k in "ab"}
        assert self.sc_ask(sc_backend, "h/1", shared, acct["a"]).admitted
        for ticket in ("a1/1", "a2/1"):
            assert not self.sc_ask(sc_backend, ticket, shared, acct["a"]).admitted
        assert not self.sc_ask(sc_backend, "b1/1", shared, acct["b"]).admitted
        # Arrival alone would hand the slot to a1; account b has not been served yet, a just was.
        assert sc_backend.release("", "h/1").tickets == ("b1/1",)
        assert sc_backend.release("", "b1/1").tickets == ("a1/1",)
        assert sc_backend.release("", "a1/1").tickets == ("a2/1",)

    def test_keys_of_a_shared_resource_take_turns(self, sc_backend: AdmissionBackend, res: str) -> None:
        shared = Constraint(f"{res}:openai", 1)
        acct = {k: Constraint(f"{res}:acct-{k}", 5) for k in "abc"}
        assert self.sc_ask(sc_backend, "h/1", shared).admitted
        # a's backlog arrived first; b and c arrive behind it.
        for ticket, key in [("a1/1", "a"), ("a2/1", "a"), ("a3/1", "a"), ("b1/1", "b"), ("b2/1", "b"), ("c1/1", "c")]:
            assert not self.sc_ask(sc_backend, ticket, shared, acct[key]).admitted
        order, holder = [], "h/1"
        for _ in range(6):
            (holder,) = sc_backend.release("", holder).tickets
            order.append(holder)
        # Never-served keys first (oldest first among them), then the key served longest ago.
        assert order == ["a1/1", "b1/1", "c1/1", "a2/1", "b2/1", "a3/1"]

    def test_a_keys_blocked_backlog_does_not_hide_another_keys_waiter_behind_it(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        """Account a is at its own limit with 300 calls waiting behind it (more than a page of
        the line, more than 200 to pass over) and was served before b, so a's calls rank first;
        b's call arrived after them. A freed shared slot must reach b, not stop at a's blocked
        backlog."""
        shared = Constraint(f"{res}:openai", 3)
        acct = {k: Constraint(f"{res}:acct-{k}", 2) for k in "abc"}
        for ticket, key in [("ha1/1", "a"), ("ha2/1", "a"), ("hb/1", "b")]:
            assert self.sc_ask(sc_backend, ticket, shared, acct[key]).admitted
        assert sc_backend.release("", "hb/1").tickets == ()  # b was served after a
        assert self.sc_ask(sc_backend, "hc/1", shared, acct["c"]).admitted  # the shared slots are full
        for i in range(300):
            assert not self.sc_ask(sc_backend, f"a{i}/1", shared, acct["a"]).admitted
        assert not self.sc_ask(sc_backend, "b1/1", shared, acct["b"]).admitted
        # c's release frees the shared slot alone (nobody waits on c's own key).
        assert sc_backend.release("", "hc/1").tickets == ("b1/1",)
        assert sc_backend.release("", "ha1/1").tickets == ("a0/1",)  # a has room again: its oldest

    def test_a_key_served_least_recently_goes_first_behind_another_keys_long_backlog(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        """Account a was served after b and has 250 calls waiting that all fit (more than a page
        of 200 by arrival); b's one call arrived after them. Fairness is over the whole line, not
        a page of it: the freed shared slot goes to b first, then back to a's oldest."""
        shared = Constraint(f"{res}:openai", 1)
        acct = {k: Constraint(f"{res}:acct-{k}", 5) for k in "ab"}
        assert self.sc_ask(sc_backend, "hb/1", shared, acct["b"]).admitted
        assert sc_backend.release("", "hb/1").tickets == ()
        assert self.sc_ask(sc_backend, "ha/1", shared, acct["a"]).admitted  # a was served last
        for i in range(250):
            assert not self.sc_ask(sc_backend, f"a{i}/1", shared, acct["a"]).admitted
        assert not self.sc_ask(sc_backend, "b1/1", shared, acct["b"]).admitted
        assert sc_backend.release("", "ha/1").tickets == ("b1/1",)
        assert sc_backend.release("", "b1/1").tickets == ("a0/1",)

    def test_a_queues_grant_passes_over_more_than_a_page_of_constraint_blocked_waiters(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        """A queue with room, and 250 waiters ahead that their step concurrency blocks: the
        queue's grant reaches the call behind them."""
        queue = f"q-{uuid.uuid4().hex[:8]}"
        sc_backend.register(QueueConfig(name=queue, concurrency=1))
        acct_a = Constraint(f"{res}:acct-a", 1)
        assert self.sc_ask(sc_backend, "ha/1", acct_a).admitted  # a's key is full (no queue)
        assert self.sc_ask(sc_backend, "q0/1", queue=queue).admitted  # the queue is full
        for i in range(250):
            assert not self.sc_ask(sc_backend, f"a{i}/1", acct_a, queue=queue).admitted
        assert not self.sc_ask(sc_backend, "b1/1", queue=queue).admitted
        assert sc_backend.release(queue, "q0/1").tickets == ("b1/1",)

    def test_priority_ranks_before_the_key_served_least_recently(self, sc_backend: AdmissionBackend, res: str) -> None:
        shared = Constraint(f"{res}:openai", 1)
        acct = {k: Constraint(f"{res}:acct-{k}", 5) for k in "ab"}
        assert self.sc_ask(sc_backend, "h/1", shared, acct["a"]).admitted
        assert not self.sc_ask(sc_backend, "b1/1", shared, acct["b"]).admitted
        assert not self.sc_ask(sc_backend, "a1/1", shared, acct["a"], priority=5).admitted
        assert sc_backend.release("", "h/1").tickets == ("a1/1",)

    def test_calls_needing_the_shared_resource_alone_take_their_turn_as_one_key(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        shared, acct_a = Constraint(f"{res}:openai", 1), Constraint(f"{res}:acct-a", 5)
        assert self.sc_ask(sc_backend, "h/1", shared).admitted  # a workflow with only the shared key
        assert not self.sc_ask(sc_backend, "s1/1", shared).admitted
        assert not self.sc_ask(sc_backend, "s2/1", shared).admitted
        assert not self.sc_ask(sc_backend, "a1/1", shared, acct_a).admitted
        # The shared-only calls were just served; account a never was: it goes first, then they alternate.
        assert sc_backend.release("", "h/1").tickets == ("a1/1",)
        assert sc_backend.release("", "a1/1").tickets == ("s1/1",)
        assert sc_backend.release("", "s1/1").tickets == ("s2/1",)

    def _two_queues(self, backend: AdmissionBackend) -> tuple[str, str, set[str]]:
        """A queue that will be paused, an open one, and the paused set the backend watches."""
        paused_q, open_q = f"q-{uuid.uuid4().hex[:8]}", f"q-{uuid.uuid4().hex[:8]}"
        backend.register(QueueConfig(name=paused_q, concurrency=5))
        backend.register(QueueConfig(name=open_q, concurrency=5))
        paused: set[str] = set()
        backend.watch_pauses(lambda: frozenset(paused))
        return paused_q, open_q, paused

    def test_a_freed_resource_passes_over_a_paused_queue_whose_waiter_keeps_its_place(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        paused_q, _, paused = self._two_queues(sc_backend)
        c = Constraint(res, 1)
        # The others wait on no queue, so each release offers the resource alone.
        assert self.sc_ask(sc_backend, "h/1", c).admitted
        assert not self.sc_ask(sc_backend, "p/1", c, queue=paused_q).admitted  # the oldest waiter
        assert not self.sc_ask(sc_backend, "o1/1", c).admitted
        assert not self.sc_ask(sc_backend, "o2/1", c).admitted
        paused.add(paused_q)
        assert sc_backend.release("", "h/1").tickets == ("o1/1",)
        paused.clear()
        assert sc_backend.release("", "o1/1").tickets == ("p/1",)  # still ahead of o2

    def test_a_resumed_queue_is_granted_the_resource_it_was_passed_over_for(
        self, sc_backend: AdmissionBackend, res: str
    ) -> None:
        paused_q, open_q, paused = self._two_queues(sc_backend)
        c = Constraint(res, 1)
        assert self.sc_ask(sc_backend, "h/1", c, queue=open_q).admitted
        assert not self.sc_ask(sc_backend, "p/1", c, queue=paused_q).admitted
        paused.add(paused_q)
        assert sc_backend.release(open_q, "h/1").tickets == ()
        assert sc_backend.resource_usage([res]) == {res: (0, 1)}
        paused.clear()
        assert sc_backend.grant(paused_q).tickets == ("p/1",)
