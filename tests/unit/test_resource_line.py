"""`ResourceLine` (the `local` backend's index of one resource's waiters) always pops the waiter a
full sort would put first: random adds, removals, serves (which only grow) and pops, checked
against a brute-force ranking after every step. Seeded, so a failure names a reproducible seed."""

from __future__ import annotations

import random

import pytest

from durable_flow.admission.base import Constraint
from durable_flow.admission.rules.resource_line import NEVER_SERVED, SOLO, ResourceLine
from durable_flow.admission.rules.resources import MAX_SCAN, ResourceState


@pytest.mark.parametrize("seed", range(20))
def test_pop_best_is_the_brute_force_first(seed: int) -> None:
    rnd = random.Random(seed)
    line = ResourceLine()
    members: dict[str, tuple[int, int, str]] = {}  # ticket -> (priority, arrival, group)
    served: dict[str, int] = {}
    serve = 0

    def served_of(group: str) -> int:
        return served.get(group, NEVER_SERVED)

    def expected() -> str | None:
        ranked = sorted(members, key=lambda t: (-members[t][0], served_of(members[t][2]), members[t][1]))
        return ranked[0] if ranked else None

    for n in range(600):
        roll = rnd.random()
        if roll < 0.45:
            ticket, group = f"t{n}", rnd.choice([SOLO, "a", "b", "c", "d"])
            members[ticket] = (rnd.choice([0, 0, 0, 1]), n, group)
            line.add(ticket, members[ticket][0], n, group)
        elif roll < 0.6 and members:
            ticket = rnd.choice(sorted(members))
            del members[ticket]
            line.remove(ticket)
        elif roll < 0.8:
            served[rnd.choice([SOLO, "a", "b", "c", "d"])] = serve
            serve += 1
        else:
            want = expected()
            assert line.pop_best(served_of) == want, f"seed {seed}, step {n}"
            if want is not None:
                del members[want]
        assert len(line) == len(members)


def test_skipped_groups_are_passed_over_whole_until_unskip() -> None:
    line = ResourceLine()
    for ticket, group, arrival in [("a1", "a", 0), ("a2", "a", 1), ("b1", "b", 2), ("s1", SOLO, 3)]:
        line.add(ticket, 0, arrival, group)

    def served_of(group: str) -> int:
        return NEVER_SERVED

    assert line.pop_best(served_of, {"a"}) == "b1"
    assert line.pop_best(served_of, {"a"}) == "s1"
    assert line.pop_best(served_of, {"a"}) is None
    line.unskip()
    assert line.pop_best(served_of) == "a1"
    assert line.pop_best(served_of) == "a2"


def test_a_key_full_at_its_own_limit_is_passed_over_whole_beyond_max_scan() -> None:
    """Key a is full and served least recently, with more waiters than MAX_SCAN ahead of b's
    one: the freed shared slot passes a over as one key and reaches b."""
    state = ResourceState()
    shared, a, b = Constraint("openai", 2), Constraint("acct-a", 1), Constraint("acct-b", 1)
    state.take("ha", (shared, a))
    state.take("hb", (shared, b))
    state.free("hb")  # b was served after a; a is full
    state.take("hs", (shared,))
    for i in range(MAX_SCAN + 10):
        state.wait(f"a{i}", "", 0, (shared, a))
    state.wait("b1", "", 0, (shared, b))
    state.free("hs")
    assert state.offer("openai", lambda need, ticket: True, ()) == ["b1"]
    assert len(state.lines["openai"]) == MAX_SCAN + 10  # a's calls keep their place
