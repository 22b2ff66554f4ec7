"""Adaptive worker concurrency: a control loop that moves a worker's live limit at runtime.

Pure decision logic: no clock, no I/O. The runtime feeds it every finished task
(`record(latency_ms, ok)`) and ticks it every `tick_ms` with a `ResourceSample`; tests drive
it with a synthetic latency series and their own `now_ms`.

The algorithm is a latency-gradient limiter in the spirit of Netflix's concurrency-limits
(Gradient2), with AIMD-style steps and a hard brake on resources:

* Baseline. Each kind of task (a workflow turn, a step) has its own baseline: the lowest
  window-mean latency observed, its "no-queuing" latency. A worker's threads do not queue
  inside the pool, so latency above the baseline means the tasks contend for something shared
  (database, CPU, the GIL, a downstream API): more concurrency no longer buys throughput. A
  window's inflation is the task-weighted mean of latency/baseline over the kinds, so a mix of
  fast turns and slow steps is not mistaken for queuing. The mean, not the p95, drives the
  decisions: the p95 of a mix measures its slowest kind of work, not contention (the p95 is
  still shown in the reason and on the heartbeat). A baseline only drifts up (5 % of the gap
  per window) on windows that cannot be queuing — the pool was not saturated, or the limit is
  at its floor — so a lasting change of the work itself is learned, but overload is not.
* Saturation. Growing only helps when the pool is the bottleneck. By Little's law the busy
  share of the pool over a window is Σ(latency) / (window x limit); the pool counts as at
  full load when that is ≥ 80 % or every slot is taken at the tick.
* Grow when latency ≤ 1.2 x baseline at full load: double while no congestion has been seen yet
  (slow start, so a fresh worker reaches a useful limit in a few ticks), then +1 per window
  (additive increase).
* Shrink when latency > 2 x baseline (queuing): multiply by the gradient
  clamp(1.5 x baseline / latency, 0.5, 0.9) — the further latency is above tolerance, the harder
  the cut; when ≥ 25 % of the window's tasks failed (errors often mean an overloaded
  downstream): x 0.75; when nothing finished for max(10 x baseline, 2 ticks) while tasks are
  in flight (a stall): x 0.5.
* Brake when RAM (the host's, or the container's if its cgroup sets a limit) is above
  `ram_ceiling_pct`, or machine CPU above `cpu_ceiling_pct` when set: halve the limit at
  once, every tick, whatever the latency says. Growth is also refused while within 5 points
  of a ceiling.
* Latency decisions need at least `MIN_SAMPLES` completions; with long tasks a window simply
  spans several ticks. The limit never leaves [min, max], and every move is an `Adjustment`
  whose reason reads like "grow 4→5: step latency 41ms (p95 52ms) ≤ 1.2x baseline 38ms at full
  load (93% busy)".
"""

from __future__ import annotations

import math
import threading

from durable_flow.config.concurrency import AdaptiveSpec
from durable_flow.runtime.concurrency import Adjustment, ResourceSample


def _percentile(ordered: list[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def _ms(value: float) -> str:
    return f"{value:.0f}ms" if value >= 10 else f"{value:.1f}ms"


class AdaptiveConcurrency:
    """A `ConcurrencyController` whose limit follows latency, errors, stalls, RAM and CPU."""

    mode = "adaptive"

    GROW_TOLERANCE = 1.2
    QUEUE_TOLERANCE = 2.0
    GRADIENT_TOLERANCE = 1.5
    SATURATION = 0.8
    ERROR_RATE = 0.25
    ERROR_FACTOR = 0.75
    STALL_FACTOR = 0.5
    BRAKE_FACTOR = 0.5
    BASELINE_DRIFT = 0.05
    CEILING_MARGIN_PCT = 5.0
    MIN_SAMPLES = 3

    def __init__(
        self,
        min_limit: int = 1,
        max_limit: int = 32,
        start: int | None = None,
        tick_ms: int = 2000,
        ram_ceiling_pct: float = 85.0,
        cpu_ceiling_pct: float | None = None,
    ) -> None:
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.limit = min_limit if start is None else start
        self.tick_ms = tick_ms
        self.ram_ceiling_pct = ram_ceiling_pct
        self.cpu_ceiling_pct = cpu_ceiling_pct
        self.last_adjustment: Adjustment | None = None
        #: The no-queuing mean latency of each kind of task, learned from the windows.
        self.baselines: dict[str, float] = {}
        self.slow_start = True
        self._lock = threading.Lock()
        self._latencies: list[tuple[str, float]] = []
        self._errors = 0
        self._window_start_ms: int | None = None
        self._last_tick_ms: int | None = None
        self._last_completion_ms: int | None = None

    # -- configuration -------------------------------------------------------------------------
    @classmethod
    def from_parsed(cls, spec: AdaptiveSpec) -> AdaptiveConcurrency:
        """Build from a parsed `AdaptiveSpec` (`durable_flow.config.concurrency`)."""
        return cls(
            min_limit=spec.min_limit,
            max_limit=spec.max_limit,
            start=spec.start,
            tick_ms=spec.tick_ms,
            ram_ceiling_pct=spec.ram_ceiling_pct,
            cpu_ceiling_pct=spec.cpu_ceiling_pct,
        )

    # -- inputs ----------------------------------------------------------------------------------
    def record(self, latency_ms: float, ok: bool, kind: str = "") -> None:
        """A task finished (called from the task threads). `kind` ("turn", "step") keeps
        different kinds of work from being compared with each other's latency."""
        with self._lock:
            self._latencies.append((kind, max(0.0, float(latency_ms))))
            if not ok:
                self._errors += 1

    def tick(self, now_ms: int, sample: ResourceSample) -> Adjustment | None:
        """Decide the next limit from the window since the last decision and the resources."""
        with self._lock:
            latencies, errors = self._latencies, self._errors
            if latencies:
                self._last_completion_ms = now_ms
        previous_tick = self._last_tick_ms if self._last_tick_ms is not None else now_ms - self.tick_ms
        self._last_tick_ms = now_ms
        if self._window_start_ms is None:
            self._window_start_ms = previous_tick
        if self._last_completion_ms is None:
            self._last_completion_ms = previous_tick

        brake = self._brake(sample)
        if brake is not None:
            self._reset_window(now_ms)
            return self._move(now_ms, math.floor(self.limit * self.BRAKE_FACTOR), f"brake {{}}: {brake}")

        if not latencies:
            if sample.in_flight <= 0:
                self._window_start_ms = now_ms  # idle time is not a window of work
            return self._check_stall(now_ms, sample)
        n = len(latencies)
        if errors >= 2 and errors / n >= self.ERROR_RATE:
            self._reset_window(now_ms)
            return self._shrink(
                now_ms, self.limit * self.ERROR_FACTOR, f"{errors} of {n} tasks failed ({errors / n:.0%})"
            )
        if n < self.MIN_SAMPLES:
            return None  # let the window grow over more ticks

        window_ms = max(1, now_ms - self._window_start_ms)
        self._reset_window(now_ms)
        busy = min(1.0, sum(latency for _, latency in latencies) / (window_ms * self.limit))
        saturated = busy >= self.SATURATION or sample.in_flight >= self.limit
        by_kind: dict[str, list[float]] = {}
        for kind, latency in latencies:
            by_kind.setdefault(kind, []).append(latency)
        means = {kind: sum(values) / len(values) for kind, values in by_kind.items()}
        for kind, mean in means.items():
            if kind not in self.baselines or mean < self.baselines[kind]:
                self.baselines[kind] = mean
        # How inflated latency is against each kind's own baseline, weighted by task count.
        ratio = sum(len(by_kind[kind]) * mean / max(self.baselines[kind], 1e-3) for kind, mean in means.items()) / n
        main = max(by_kind, key=lambda kind: len(by_kind[kind]))
        p95 = _percentile(sorted(by_kind[main]), 0.95)
        shown = f"{main + ' ' if main else ''}latency {_ms(means[main])} (p95 {_ms(p95)})"
        if len(means) > 1:
            shown = f"latency {ratio:.2f}x its baselines, {shown}"
        baseline = f"baseline {_ms(self.baselines[main])}"

        if ratio > self.QUEUE_TOLERANCE:
            gradient = min(0.9, max(0.5, self.GRADIENT_TOLERANCE / ratio))
            adjustment = self._shrink(
                now_ms, self.limit * gradient, f"{shown} > {self.QUEUE_TOLERANCE:g}x {baseline} (queuing)"
            )
            if adjustment is None:  # at the floor: the latency is the work's own, learn it
                self._drift(means)
            return adjustment
        if not saturated or self.limit <= self.min_limit:
            self._drift(means)
        if saturated and ratio <= self.GROW_TOLERANCE and self._room_to_grow(sample):
            target = self.limit * 2 if self.slow_start else self.limit + 1
            label = "slow start" if self.slow_start else "grow"
            return self._move(
                now_ms,
                target,
                f"{label} {{}}: {shown} ≤ {self.GROW_TOLERANCE:g}x {baseline} at full load ({busy:.0%} busy)",
            )
        return None

    @property
    def baseline_ms(self) -> float | None:
        """The largest per-kind baseline (what a stall is measured against)."""
        return max(self.baselines.values(), default=None)

    # -- helpers ---------------------------------------------------------------------------------
    def _reset_window(self, now_ms: int) -> None:
        with self._lock:
            self._latencies = []
            self._errors = 0
        self._window_start_ms = now_ms

    def _drift(self, means: dict[str, float]) -> None:
        for kind, mean in means.items():
            if mean > self.baselines[kind]:
                self.baselines[kind] += (mean - self.baselines[kind]) * self.BASELINE_DRIFT

    def _brake(self, sample: ResourceSample) -> str | None:
        if sample.ram_pct > self.ram_ceiling_pct:
            return f"RAM {sample.ram_pct:.0f}% > ceiling {self.ram_ceiling_pct:g}%"
        if self.cpu_ceiling_pct is not None and sample.cpu_pct > self.cpu_ceiling_pct:
            return f"CPU {sample.cpu_pct:.0f}% > ceiling {self.cpu_ceiling_pct:g}%"
        return None

    def _room_to_grow(self, sample: ResourceSample) -> bool:
        if sample.ram_pct > self.ram_ceiling_pct - self.CEILING_MARGIN_PCT:
            return False
        return self.cpu_ceiling_pct is None or sample.cpu_pct <= self.cpu_ceiling_pct - self.CEILING_MARGIN_PCT

    def _check_stall(self, now_ms: int, sample: ResourceSample) -> Adjustment | None:
        if sample.in_flight <= 0 or self.baseline_ms is None or self._last_completion_ms is None:
            return None
        quiet_ms = now_ms - self._last_completion_ms
        if quiet_ms < max(10 * self.baseline_ms, 2 * self.tick_ms):
            return None
        self._last_completion_ms = now_ms  # one cut per stall period, not one per tick
        return self._shrink(
            now_ms,
            self.limit * self.STALL_FACTOR,
            f"stalled: nothing finished for {quiet_ms / 1000:.1f}s with {sample.in_flight} in flight",
        )

    def _shrink(self, now_ms: int, target: float, why: str) -> Adjustment | None:
        self.slow_start = False
        return self._move(now_ms, min(self.limit - 1, math.floor(target)), f"shrink {{}}: {why}")

    def _move(self, now_ms: int, target: float, reason: str) -> Adjustment | None:
        new = max(self.min_limit, min(self.max_limit, int(target)))
        if new == self.limit:
            return None
        if new < self.limit:
            self.slow_start = False
        adjustment = Adjustment(
            at_ms=now_ms, old_limit=self.limit, new_limit=new, reason=reason.format(f"{self.limit}→{new}")
        )
        self.limit = new
        self.last_adjustment = adjustment
        return adjustment
