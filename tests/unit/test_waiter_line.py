"""The `local` backend's waiter index finds the same next waiter as `rank` over every
waiter, through joins, refreshes, withdrawals, grants and fairness-key serves."""

from __future__ import annotations

import random

import pytest

from durable_flow.admission.rules.waiter_line import Waiter, WaiterLine, rank
from durable_flow.config.queues import QueueConfig


@pytest.mark.parametrize("fairness", ["key", "fifo"])
@pytest.mark.parametrize("order", ["fifo", "lifo"])
@pytest.mark.parametrize("seed", range(4))
def test_best_is_the_waiter_rank_puts_first(fairness: str, order: str, seed: int) -> None:
    rng = random.Random(seed)
    config = QueueConfig(name="q", concurrency=1, fairness=fairness, order=order)
    line = WaiterLine()
    served: dict[str, int] = {}
    arrival = serve = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45 or not line:
            ticket = f"t{rng.randrange(400)}"
            old = line.get(ticket)
            waiter = Waiter(ticket, rng.randrange(3), f"k{rng.randrange(6)}", old.arrival if old else arrival, 0)
            arrival += old is None
            line[ticket] = waiter  # a join, or a refresh keeping its place
        elif op < 0.6:
            line.pop(rng.choice(list(line)))  # withdrawn (cancelled, released)
        else:
            best = line.best(config, served)
            expected = min(line.values(), key=lambda w: rank(w, config, served))
            assert best is not None
            assert rank(best, config, served) == rank(expected, config, served)
            del line[best.ticket]  # granted: its key is served now
            served[best.fairness_key] = serve
            serve += 1
    while line:
        best = line.best(config, served)
        assert best is not None and best is min(line.values(), key=lambda w: rank(w, config, served))
        del line[best.ticket]
    assert line.best(config, served) is None


def test_a_refreshed_waiter_moves_to_its_new_rank() -> None:
    config = QueueConfig(name="q", concurrency=1)
    line = WaiterLine()
    line["a"] = Waiter("a", 0, "", 0, 0)
    line["b"] = Waiter("b", 0, "", 1, 0)
    assert line.best(config, {}).ticket == "a"  # type: ignore[union-attr]
    b = line["b"]
    b.priority = 5  # changed in place, then stored again (as `policy.add_waiter` does)
    line["b"] = b
    assert line.best(config, {}).ticket == "b"  # type: ignore[union-attr]


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_a_long_line_of_one_key_keeps_one_head_on_the_top_heap(order: str) -> None:
    """10,000 waiters of one fairness key: under fifo the top heap holds that key's head once,
    not one bound per waiter (a grant's cost must not grow with the line); under lifo each
    joiner ranks first and supersedes it. Every grant takes the waiter `rank` puts first."""
    config = QueueConfig(name="q", concurrency=1, order=order)
    line = WaiterLine()
    for i in range(10_000):
        line[f"t{i}"] = Waiter(f"t{i}", 0, "", i, 0)
    assert line.best(config, {}) is not None
    assert len(line._heads.top) == 1
    for _ in range(100):
        best = line.best(config, {})
        expected = min(line.values(), key=lambda w: rank(w, config, {}))
        assert best is not None and best.ticket == expected.ticket
        del line[best.ticket]
        line[f"n{best.ticket}"] = Waiter(f"n{best.ticket}", 0, "", 20_000 + int(best.ticket.lstrip("nt")), 0)
    if order == "fifo":
        assert len(line._heads.top) == 1
