"""`ResourceLine` (the `local` backend's index of one resource's waiters) always pops the waiter a
full sort would put first: random adds, removals, serves (which only grow) and pops, checked
against a brute-force ranking after every step. Seeded, so a failure names a reproducible seed."""

from __future__ import annotations

import random

import pytest

from durable_flow.admission.resource_line import NEVER_SERVED, SOLO, ResourceLine


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
