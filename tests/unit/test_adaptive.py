"""The adaptive concurrency loop, driven by a synthetic latency series and its own clock."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from durable_flow.runtime.adaptive import AdaptiveConcurrency
from durable_flow.runtime.concurrency import Adjustment, FixedConcurrency, ResourceSample
from durable_flow.runtime.controllers import build_controller

SETTING = 'DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]'
TICK = 1000


class Loop:
    """Feeds a controller one window per tick: `limit` tasks in flight the whole window
    (saturated) or fewer, each finishing after the latency the scenario says."""

    def __init__(self, controller: AdaptiveConcurrency) -> None:
        self.c = controller
        self.now = 0
        self.moves: list[Adjustment] = []

    def window(
        self,
        latency_ms: float,
        *,
        busy: float = 1.0,
        errors: int = 0,
        ram: float = 40.0,
        cpu: float = 20.0,
        kind: str = "step",
    ) -> Adjustment | None:
        # Little's law: `busy * limit` slots busy for the whole tick.
        count = max(3, round(busy * self.c.limit * TICK / latency_ms))
        for i in range(count):
            self.c.record(latency_ms, ok=i >= errors, kind=kind)
        self.now += TICK
        in_flight = self.c.limit if busy >= 1 else int(busy * self.c.limit)
        adjustment = self.c.tick(self.now, ResourceSample(ram_pct=ram, cpu_pct=cpu, in_flight=in_flight))
        if adjustment is not None:
            self.moves.append(adjustment)
        assert self.c.min_limit <= self.c.limit <= self.c.max_limit
        return adjustment


def make(**spec: object) -> AdaptiveConcurrency:
    controller = build_controller({"mode": "adaptive", "tick_ms": TICK, **spec}, setting=SETTING)
    assert isinstance(controller, AdaptiveConcurrency)
    return controller


def test_spec_defaults_and_string_form() -> None:
    controller = build_controller("adaptive", setting=SETTING)
    assert isinstance(controller, AdaptiveConcurrency)
    assert (controller.min_limit, controller.max_limit, controller.limit, controller.tick_ms) == (1, 32, 1, 2000)
    assert (controller.ram_ceiling_pct, controller.cpu_ceiling_pct) == (85.0, None)
    custom = make(min=2, max=10, start=4, ram_ceiling_pct=70, cpu_ceiling_pct=90)
    assert (custom.min_limit, custom.max_limit, custom.limit, custom.cpu_ceiling_pct) == (2, 10, 4, 90.0)
    assert isinstance(build_controller(3), FixedConcurrency)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"min": 0}, '["min"]'),
        ({"max": "lots"}, '["max"]'),
        ({"min": 5, "max": 2}, '["max"]'),
        ({"start": 40}, '["start"]'),
        ({"tick_ms": 0}, '["tick_ms"]'),
        ({"ram_ceiling_pct": 150}, '["ram_ceiling_pct"]'),
        ({"cpu_ceiling_pct": True}, '["cpu_ceiling_pct"]'),
        ({"ceiling": 3}, ": unknown option(s) ceiling (known: mode, min"),
    ],
)
def test_invalid_spec_names_the_setting_and_field(spec: dict[str, object], field: str) -> None:
    with pytest.raises(ImproperlyConfigured) as info:
        build_controller({"mode": "adaptive", **spec}, setting=SETTING)
    assert str(info.value).startswith(SETTING) and field in str(info.value)


def test_grows_while_latency_stays_at_baseline_under_full_load() -> None:
    loop = Loop(make(max=20))
    for _ in range(12):
        loop.window(40)
    # Slow start doubles 1→2→4→8→16, then the cap.
    assert [(m.old_limit, m.new_limit) for m in loop.moves] == [(1, 2), (2, 4), (4, 8), (8, 16), (16, 20)]
    assert loop.c.limit == 20
    assert loop.moves[0].reason.startswith("slow start 1→2: step latency 40ms")
    assert "≤ 1.2x baseline 40ms at full load" in loop.moves[0].reason


def test_does_not_grow_when_the_pool_is_not_saturated() -> None:
    loop = Loop(make(start=4))
    for _ in range(5):
        loop.window(40, busy=0.5)
    assert loop.moves == [] and loop.c.limit == 4


def test_shrinks_when_latency_shows_queuing_then_grows_additively() -> None:
    loop = Loop(make(max=32))
    for _ in range(3):
        loop.window(40)  # 1→2→4→8
    assert loop.c.limit == 8
    # Contention: latency triples at this concurrency.
    shrink = loop.window(120)
    assert shrink is not None and shrink.new_limit < 8
    assert shrink.new_limit == 4  # gradient clamp(1.5 * 40 / 120, 0.5, 0.9) = 0.5
    assert "queuing" in shrink.reason and "> 2x baseline 40ms" in shrink.reason
    # Back to baseline latency: no more slow start, +1 per window.
    loop.window(40)
    loop.window(40)
    assert [(m.old_limit, m.new_limit) for m in loop.moves[-2:]] == [(4, 5), (5, 6)]
    assert loop.moves[-1].reason.startswith("grow 5→6")


def test_moderate_inflation_holds_the_limit() -> None:
    loop = Loop(make(start=6))
    loop.window(40, busy=0.5)  # learn the baseline without growing
    assert loop.window(60) is None  # 1.5x baseline: neither headroom nor queuing
    assert loop.c.limit == 6


def test_error_spike_shrinks() -> None:
    loop = Loop(make(start=8))
    adjustment = loop.window(40, errors=100)  # 100 of 200
    assert adjustment is not None and adjustment.new_limit == 6
    assert adjustment.reason == "shrink 8→6: 100 of 200 tasks failed (50%)"


def test_stall_shrinks_when_nothing_finishes() -> None:
    loop = Loop(make(start=8))
    loop.window(40)  # baseline 40ms; grows to 16
    limit = loop.c.limit
    moves = [loop.c.tick(loop.now + TICK * i, ResourceSample(40, 20, in_flight=limit)) for i in (1, 2, 3)]
    stalls = [m for m in moves if m is not None]
    assert len(stalls) == 1 and stalls[0].new_limit == limit // 2
    assert stalls[0].reason.startswith(f"shrink {limit}→{limit // 2}: stalled")


def test_ram_over_ceiling_hard_brakes_down_to_min() -> None:
    loop = Loop(make(min=2, start=16, ram_ceiling_pct=80))
    brake = loop.window(40, ram=91)
    assert brake is not None and (brake.old_limit, brake.new_limit) == (16, 8)
    assert brake.reason == "brake 16→8: RAM 91% > ceiling 80%"
    loop.window(40, ram=91)
    loop.window(40, ram=91)
    loop.window(40, ram=91)
    assert loop.c.limit == 2  # never below min
    # Near the ceiling it does not grow again, even with perfect latency.
    loop.window(40, ram=78)
    assert loop.c.limit == 2
    loop.window(40, ram=50)
    assert loop.c.limit == 3


def test_cpu_brake_only_when_a_ceiling_is_set() -> None:
    off = Loop(make(start=8))
    off.window(40, busy=0.5, cpu=99)
    assert off.c.limit == 8
    on = Loop(make(start=8, cpu_ceiling_pct=90))
    brake = on.window(40, cpu=97)
    assert brake is not None and brake.new_limit == 4 and brake.reason == "brake 8→4: CPU 97% > ceiling 90%"


def test_mixed_fast_turns_and_slow_steps_are_not_mistaken_for_queuing() -> None:
    controller = make()
    now = 0
    for _ in range(5):
        for _ in range(3):
            controller.record(150, True, "step")
        for _ in range(20):
            controller.record(5, True, "turn")
        now += TICK
        controller.tick(now, ResourceSample(30, 20, in_flight=controller.limit))
    assert controller.limit == 32  # slow start all the way: the mix never looked like queuing
    assert set(controller.baselines) == {"step", "turn"}
    assert controller.last_adjustment is not None and "its baselines" in controller.last_adjustment.reason


def test_stays_in_bounds_under_a_noisy_series() -> None:
    import random

    rng = random.Random(7)
    loop = Loop(make(min=2, max=12, start=3))
    for _ in range(300):
        loop.window(
            rng.choice([20, 25, 30, 60, 200]),
            busy=rng.choice([0.3, 1.0, 1.0]),
            errors=rng.choice([0, 0, 0, 5]),
            ram=rng.choice([40, 40, 95]),
        )
    assert loop.moves, "the loop moved"
    assert all(2 <= m.new_limit <= 12 and m.reason for m in loop.moves)
    assert loop.c.last_adjustment == loop.moves[-1]
    assert all(m.at_ms % TICK == 0 for m in loop.moves)


def test_few_samples_wait_for_a_longer_window() -> None:
    controller = make(start=2)
    controller.record(3000, True, "step")
    assert controller.tick(TICK, ResourceSample(30, 20, in_flight=2)) is None
    controller.record(3000, True, "step")
    assert controller.tick(2 * TICK, ResourceSample(30, 20, in_flight=2)) is None
    controller.record(3000, True, "step")
    adjustment = controller.tick(3 * TICK, ResourceSample(30, 20, in_flight=2))
    assert adjustment is not None and adjustment.new_limit == 4  # one 3-tick window, saturated
