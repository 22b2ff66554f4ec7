"""Workflows and steps the test suite runs (registered through settings.test's WORKFLOWS).

Steps record each execution in `tests.workflows.EXECUTIONS` (same process) and, for
multi-process tests, as rows of a marker file, so tests can count how often a step ran.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

from durable_flow import current_step, step, workflow

EXECUTIONS: list[tuple[str, Any]] = []
FAILURES_LEFT: dict[str, int] = {}


def _mark(name: str, value: Any) -> None:
    EXECUTIONS.append((name, value))
    marker = os.environ.get("DURABLE_FLOW_TEST_MARKER")
    if marker:
        with open(marker, "a") as handle:
            handle.write(f"{name} {value} {os.getpid()} {time.time():.6f}\n")


@step("tests.add_one")
def add_one(n: int) -> int:
    _mark("add_one", n)
    return n + 1


@step("tests.double")
def double(n: int) -> int:
    _mark("double", n)
    return n * 2


@step("tests.slow")
def slow(payload: dict[str, Any]) -> dict[str, Any]:
    """Sleeps `seconds`; used to kill a worker mid-step."""
    _mark("slow_start", payload.get("id"))
    time.sleep(payload.get("seconds", 1.0))
    _mark("slow_end", payload.get("id"))
    return payload


@step("tests.flaky", retries=3, backoff=timedelta(seconds=1))
def flaky(key: str) -> str:
    """Fails while FAILURES_LEFT[key] > 0."""
    _mark("flaky", key)
    left = FAILURES_LEFT.get(key, 0)
    if left > 0:
        FAILURES_LEFT[key] = left - 1
        raise RuntimeError(f"flaky {key} failing, {left} left")
    return f"ok {key}"


@step("tests.always_fails", retries=1, backoff=timedelta(seconds=1))
def always_fails(_: Any) -> None:
    _mark("always_fails", None)
    raise ValueError("boom")


@step("tests.bad_output")
def bad_output(_: Any) -> Any:
    return {"not json": object()}


@step("tests.echo")
def echo(value: Any) -> Any:
    _mark("echo", value)
    return value


@workflow("tests.three_steps")
def three_steps(ctx: Any, n: int) -> int:
    a = ctx.step(add_one, n)
    b = ctx.step(double, a)
    return ctx.step(add_one, b)


@workflow("tests.sleeper")
def sleeper(ctx: Any, seconds: float) -> str:
    ctx.sleep(timedelta(seconds=seconds))
    return ctx.step(echo, "woke")


@workflow("tests.slow_one")
def slow_one(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    return ctx.step(slow, payload)


@workflow("tests.fan")
def fan(ctx: Any, payload: dict[str, Any]) -> list[int]:
    return ctx.all(double, list(range(payload["n"])), concurrency=payload.get("concurrency"))


@workflow("tests.flaky_flow")
def flaky_flow(ctx: Any, key: str) -> str:
    return ctx.step(flaky, key)


@workflow("tests.fails")
def fails(ctx: Any, _: Any) -> None:
    ctx.step(always_fails, None)


@workflow("tests.catches")
def catches(ctx: Any, _: Any) -> str:
    from durable_flow import StepFailed

    try:
        ctx.step(always_fails, None)
    except StepFailed as exc:
        return f"caught {exc.step}"
    return "not reached"


@workflow("tests.child_parent")
def child_parent(ctx: Any, n: int) -> int:
    return ctx.child(three_steps, n) + 1000


@workflow("tests.child_fan")
def child_fan(ctx: Any, payload: dict[str, Any]) -> list[int]:
    return ctx.all(three_steps, list(range(payload["n"])), concurrency=payload.get("concurrency"))


@workflow("tests.signal_waiter")
def signal_waiter(ctx: Any, timeout_s: float | None) -> Any:
    from durable_flow import SignalTimeout

    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    try:
        return {"got": ctx.wait_for_signal("approve", timeout=timeout)}
    except SignalTimeout:
        return {"timed_out": True}


@workflow("tests.queued")
def queued(ctx: Any, payload: dict[str, Any]) -> Any:
    """One step through a flow-control queue, with the hints the payload gives."""
    return ctx.step(
        slow if payload.get("seconds") else echo,
        payload if payload.get("seconds") else payload.get("value", payload.get("id")),
        queue=payload["queue"],
        priority=payload.get("priority", 0),
        fairness_key=payload.get("key"),
    )


@workflow("tests.bad_output_flow")
def bad_output_flow(ctx: Any, _: Any) -> Any:
    return ctx.step(bad_output, None)


@workflow("tests.timeout_flow")
def timeout_flow(ctx: Any, payload: dict[str, Any]) -> Any:
    return ctx.step(slow, payload, timeout=timedelta(seconds=payload["timeout"]), queue=payload.get("queue"))


@workflow("tests.nondeterministic", version="1")
def nondeterministic(ctx: Any, _: Any) -> Any:
    # Which step runs first depends on a module-level switch, to simulate a code change.
    first = double if os.environ.get("DF_TEST_SWAP") == "1" else add_one
    a = ctx.step(first, 1)
    ctx.sleep(timedelta(seconds=10))
    return a


@workflow("tests.fan_with_queue")
def fan_with_queue(ctx: Any, payload: dict[str, Any]) -> list[int]:
    return ctx.all(double, list(range(payload["n"])), queue="render")


@workflow("tests.flaky_queued")
def flaky_queued(ctx: Any, payload: dict[str, Any]) -> str:
    return ctx.step(flaky, payload["key"], queue=payload["queue"])


# -- engine-core tests (tests/unit/test_engine_*.py, tests/processes/test_processes.py) ----------

#: Events the `gate` step waits on, by input; a test sets one to let that step finish.
GATES: dict[str, Any] = {}


@step("tests.gate")
def gate(name: str) -> str:
    """Blocks until the test sets `GATES[name]` (at most 10 s), so a step is provably mid-flight."""
    _mark("gate_start", name)
    event = GATES.get(name)
    if event is not None:
        event.wait(10)
    _mark("gate_end", name)
    return f"opened {name}"


@step("tests.sized")
def sized(n: int) -> str:
    """Returns a string of `n` characters (for payload-size limits)."""
    return "x" * n


def not_a_step(value: Any) -> Any:
    """A plain function: `ctx.step` must refuse it."""
    return value


@workflow("tests.gated")
def gated(ctx: Any, name: str) -> str:
    return ctx.step(gate, name)


@workflow("tests.sleep_then_signal")
def sleep_then_signal(ctx: Any, seconds: float) -> Any:
    ctx.sleep(timedelta(seconds=seconds))
    return {"got": ctx.wait_for_signal("approve")}


@workflow("tests.child_of_failing")
def child_of_failing(ctx: Any, _: Any) -> Any:
    from durable_flow import ChildFailed

    try:
        ctx.child(fails, None)
    except ChildFailed as exc:
        return {"child": exc.run_id, "status": exc.status}
    return "not reached"


@workflow("tests.plain_function_step")
def plain_function_step(ctx: Any, _: Any) -> Any:
    return ctx.step(not_a_step, 1)  # type: ignore[arg-type]


@workflow("tests.non_json_step_input")
def non_json_step_input(ctx: Any, _: Any) -> Any:
    return ctx.step(echo, {"when": {1, 2}})


@workflow("tests.sized_output")
def sized_output(ctx: Any, n: int) -> Any:
    return ctx.step(sized, n)


@workflow("tests.step_then_sleep")
def step_then_sleep(ctx: Any, seconds: float) -> Any:
    first = ctx.step(gate, "before-sleep")
    ctx.sleep(timedelta(seconds=seconds))
    return first


@workflow("tests.three_then_sleep")
def three_then_sleep(ctx: Any, n: int) -> int:
    """A few steps, then a long sleep: a run with a timeline to look at and to cancel."""
    total = ctx.step(add_one, n)
    total = ctx.step(double, total)
    ctx.sleep(timedelta(hours=1))
    return ctx.step(add_one, total)


@step("tests.maybe_fail")
def maybe_fail(n: int) -> int:
    if n < 0:
        raise ValueError("negative")
    return n


@workflow("tests.child_of_fan")
def child_of_fan(ctx: Any, n: int) -> int:
    return ctx.step(maybe_fail, n)


@workflow("tests.child_fan_one_fails")
def child_fan_one_fails(ctx: Any, payload: dict[str, Any]) -> list[int]:
    return ctx.all(child_of_fan, [-1, *range(1, payload["n"])], concurrency=payload.get("concurrency"))


@workflow("tests.catches_everything")
def catches_everything(ctx: Any, payload: dict[str, Any]) -> str:
    """A workflow that tries to swallow every error around a step."""
    try:
        ctx.step(echo, 1, queue=payload["queue"])
    except Exception as exc:  # noqa: BLE001 - the point of the test
        return f"swallowed {type(exc).__name__}"
    return "done"


@workflow("tests.echo_flow")
def echo_flow(ctx: Any, value: Any) -> Any:
    return ctx.step(echo_raw, value)


@workflow("tests.echo_then_step")
def echo_then_step(ctx: Any, value: Any) -> Any:
    """`echo_flow`, then a second step: its dispatch is a statement the first result's turn sends."""
    ctx.step(echo_raw, value)
    return ctx.step(echo_raw, "second")


@step("tests.echo_raw")
def echo_raw(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\\x00", "\x00")
    return value


@workflow("tests.queued_or_nul")
def queued_or_nul(ctx: Any, payload: dict[str, Any]) -> Any:
    """Like `tests.queued`, or with a step input the workflow itself builds with a NUL in it."""
    value = "x" + chr(0) if payload.get("nul_input") else payload["value"]
    return ctx.step(echo, value, queue=payload["queue"], priority=payload.get("priority", 0))


@workflow("tests.nul_fairness")
def nul_fairness(ctx: Any, _: Any) -> Any:
    """A fairness key the database cannot store, computed inside the workflow."""
    return ctx.step(echo, 1, fairness_key="k" + chr(0))


@workflow("tests.step_then_flaky")
def step_then_flaky(ctx: Any, key: str) -> str:
    """A step that completes, then one that fails at once while FAILURES_LEFT[key] > 0."""
    ctx.step(echo, key)
    return ctx.step(flaky, key, retries=0)


@workflow("tests.parent_of_flaky")
def parent_of_flaky(ctx: Any, key: str) -> Any:
    return {"child": ctx.child("tests.step_then_flaky", key)}


# -- metrics and tasks tests (tests/processes/test_metrics.py, tests/processes/test_tasks.py) ----


@step("tests.file_gate")
def file_gate(payload: dict[str, Any]) -> str:
    """Blocks until the file `payload["path"]` exists (at most 60 s): a gate another process opens."""
    _mark("file_gate", payload.get("id", ""))
    deadline = time.monotonic() + 60
    while not os.path.exists(payload["path"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return payload.get("id", "")


@workflow("tests.file_gated")
def file_gated(ctx: Any, payload: dict[str, Any]) -> str:
    return ctx.step(file_gate, payload, queue=payload.get("queue"))


# -- dashboard browser tests (tests/browser/test_browser_runs.py) --------------------------------


@step("tests.needs_file", retries=1, backoff=timedelta(milliseconds=200))
def needs_file(payload: dict[str, Any]) -> str:
    """Fails until the file `payload["path"]` exists: a cause another process fixes."""
    if not os.path.exists(payload["path"]):
        raise FileNotFoundError(f"config file {payload['path']} is missing")
    return "imported"


@workflow("tests.needs_file_flow")
def needs_file_flow(ctx: Any, payload: dict[str, Any]) -> str:
    ctx.step(echo, "prepare")
    return ctx.step(needs_file, payload)


@workflow("tests.two_signals")
def two_signals(ctx: Any, _: Any) -> Any:
    """Waits for `approve`, then for `ship`: the run page's awaited names change between them."""
    return [ctx.wait_for_signal("approve"), ctx.wait_for_signal("ship")]


# -- the chaos soak (tests/reliability/) ---------------------------------------------------------


def _soak_mark(event: str, payload: dict[str, Any]) -> None:
    """One line per step start/end in the soak's log: the evidence its checks read."""
    path = os.environ.get("DURABLE_FLOW_SOAK_LOG")
    if path:
        line = f"{event} {payload['run']} {payload['stage']} {os.getpid()} {time.time():.6f}\n"
        with open(path, "a") as handle:  # O_APPEND: lines from many processes do not interleave
            handle.write(line)


@step("tests.soak_stage")
def soak_stage(payload: dict[str, Any]) -> int:
    """A short step that stamps its start and end, so the soak can count executions and overlap."""
    _soak_mark("start", payload)
    time.sleep(payload["ms"] / 1000)
    _soak_mark("end", payload)
    return soak_value(payload["n"], payload["stage"])


def soak_value(n: int, stage: int) -> int:
    """What stage `stage` makes of `n`: the soak checks each run's output against it."""
    return n * 3 + stage


@workflow("tests.soak")
def soak(ctx: Any, p: dict[str, Any]) -> int:
    """Three steps, through a capped, a sliding-window and a fair queue in turn."""
    value = p["n"]
    for stage, queue, key in ((1, p["capped"], None), (2, p["window"], None), (3, p["fair"], p["tenant"])):
        payload = {"run": ctx.run_id, "stage": stage, "n": value, "ms": p["ms"]}
        value = ctx.step(soak_stage, payload, queue=queue, fairness_key=key)
    return value


@step("tests.whereami")
def whereami(fail_key: str) -> dict[str, Any]:
    """Returns `current_step()`; fails while FAILURES_LEFT[fail_key] > 0 (no retries of its own)."""
    from dataclasses import asdict

    from durable_flow import current_step

    info = asdict(current_step())
    left = FAILURES_LEFT.get(fail_key, 0)
    if left > 0:
        FAILURES_LEFT[fail_key] = left - 1
        raise RuntimeError(f"whereami {fail_key} failing at attempt {info['attempt']}")
    return info


@step("tests.whereami_async")
async def whereami_async(_: Any) -> dict[str, Any]:
    import asyncio
    from dataclasses import asdict

    from durable_flow import current_step

    await asyncio.sleep(0)
    return asdict(current_step())


@workflow("tests.whereami")
def whereami_flow(ctx: Any, fail_key: str) -> list[Any]:
    return [ctx.step(whereami, fail_key), ctx.step(whereami_async, None)]


@workflow("tests.debounced", debounce={"key": '"user:" + input.user', "period": timedelta(seconds=5)})
def debounced_flow(ctx: Any, input: dict[str, Any]) -> int:
    """Begins once starts of its user stop for 5 s (tests/processes/test_start_control.py, real processes)."""
    return ctx.step(add_one, input["n"])


@workflow("tests.two_queued")
def two_queued(ctx: Any, payload: dict[str, Any]) -> list[Any]:
    """Two steps in a row through one queue."""
    first = ctx.step(echo, payload["value"], queue=payload["queue"])
    return [first, ctx.step(double, 21, queue=payload["queue"])]


@workflow("tests.quota_sleeper", quota={"key": '"sleeper:" + input.tenant', "limit": 1})
def quota_sleeper(ctx: Any, payload: dict[str, Any]) -> str:
    """Holds its tenant's only quota slot through a sleep (retry of a run cancelled mid-sleep)."""
    ctx.sleep(timedelta(seconds=payload["seconds"]))
    return ctx.step(echo, "woke")


# -- exceptions outside `Exception` raised by user code (tests/processes/test_base_exceptions.py) ---


class CustomStop(BaseException):
    """A `BaseException` of the user's own, neither an `Exception` nor one of Python's."""


#: What `raises_base` and `body_raises_base` raise, by name (a fixed table: never an import path).
BASE_EXCEPTIONS: dict[str, type[BaseException]] = {
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "GeneratorExit": GeneratorExit,
    "CustomStop": CustomStop,
}


@step("tests.raises_base")
def raises_base(kind: str) -> None:
    """Raises the `BaseException` named `kind` (no retries: one attempt, then the run fails)."""
    _mark("raises_base", kind)
    raise BASE_EXCEPTIONS[kind](f"{kind} from a step")


@step("tests.raises_base_async")
async def raises_base_async(kind: str) -> None:
    _mark("raises_base_async", kind)
    raise BASE_EXCEPTIONS[kind](f"{kind} from an async step")


@workflow("tests.raises_base_flow")
def raises_base_flow(ctx: Any, kind: str) -> Any:
    return ctx.step(raises_base, kind)


@workflow("tests.raises_base_async_flow")
def raises_base_async_flow(ctx: Any, kind: str) -> Any:
    return ctx.step(raises_base_async, kind)


@workflow("tests.body_raises_base")
def body_raises_base(ctx: Any, payload: dict[str, Any]) -> Any:
    """Raises the `BaseException` named `payload["kind"]` in the workflow's own code, after a
    step when `payload["after_step"]` (the turn taken inline with the step's result)."""
    if payload.get("after_step"):
        ctx.step(echo, payload["kind"])
    raise BASE_EXCEPTIONS[payload["kind"]](f"{payload['kind']} from a workflow")


@step("tests.exits_once", retries=1, backoff=timedelta(milliseconds=200))
def exits_once(path: str) -> str:
    """Raises `SystemExit` the first time (it leaves the file `path` behind), then succeeds."""
    _mark("exits_once", path)
    if not os.path.exists(path):
        with open(path, "w"):
            pass
        raise SystemExit(f"exiting once ({path})")
    return "second time lucky"


@workflow("tests.exits_once_flow")
def exits_once_flow(ctx: Any, path: str) -> str:
    return ctx.step(exits_once, path)


@step("tests.signals_itself")
def signals_itself(_: Any) -> str:
    """Sends its own process SIGUSR1 and waits: the handler a test installed runs meanwhile, on
    the main thread, in the middle of this step."""
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(5)
    return "not interrupted"


@workflow("tests.signals_itself_flow")
def signals_itself_flow(ctx: Any, _: Any) -> str:
    return ctx.step(signals_itself, None)


@step("tests.stamp")
def stamp(_: Any) -> float:
    """When the step began, on the wall clock (bench/latency.py: start → step start across processes)."""
    return time.time()


@workflow("tests.stamped")
def stamped(ctx: Any, payload: dict[str, Any]) -> float:
    """One step that returns when it began, through `payload["queue"]` when given."""
    return ctx.step(stamp, None, queue=payload.get("queue"))


def _call_with_deadline(ctx: Any, payload: dict[str, Any]) -> Any:
    """One step (`tests.file_gate` with `open`, `tests.slow` with `seconds`, else `tests.echo`) through
    `queue`, with a start timeout (`start_timeout`, seconds, or `{"timedelta": s}` / `{"float":
    "nan"}` for what JSON cannot carry; `on`: fail or skip); with `catch`, the workflow catches the
    `StartTimeoutError` and returns what it says; with `then`, a second step follows."""
    from durable_flow import StartTimeoutError

    start_timeout = payload.get("start_timeout")
    if isinstance(start_timeout, dict):  # JSON has no timedelta, NaN or infinity: built here
        start_timeout = (
            timedelta(seconds=start_timeout["timedelta"])
            if "timedelta" in start_timeout
            else float(start_timeout["float"])
        )

    def call() -> Any:
        value = payload.get("value")
        if payload.get("open"):
            target, argument = file_gate, {"id": value, "path": payload["open"]}
        elif payload.get("seconds"):
            target, argument = slow, {"id": value, "seconds": payload["seconds"]}
        else:
            target, argument = echo, value
        return ctx.step(
            target,
            argument,
            queue=payload.get("queue"),
            start_timeout=start_timeout,
            on_start_timeout=payload.get("on"),
        )

    if payload.get("catch"):
        try:
            return {"result": call()}
        except StartTimeoutError as exc:
            return {"gave_up": str(exc), "queue": exc.queue, "waited_s": exc.waited_s, "held_by": exc.held_by}
    result = call()
    if payload.get("then"):
        return {"result": result, "then": ctx.step(echo, payload["then"])}
    return result


@workflow("tests.queued_deadline")
def queued_deadline(ctx: Any, payload: dict[str, Any]) -> Any:
    """A step through a flow-control queue with a start timeout (`_call_with_deadline`)."""
    return _call_with_deadline(ctx, payload)


@workflow("tests.keyed_deadline", concurrency={"limit": 1, "key": "input.account"})
def keyed_deadline(ctx: Any, payload: dict[str, Any]) -> Any:
    """`tests.queued_deadline` under step concurrency: one step at a time per account."""
    return _call_with_deadline(ctx, payload)


@workflow("tests.sleep_then_stamp")
def sleep_then_stamp(ctx: Any, payload: dict[str, Any]) -> float:
    """Sleeps `payload["s"]` seconds, then one step that returns when it began (a timer's
    lateness: the stamp less the sleep's `wake_at`; bench/timers.py, tests/processes/test_timers.py)."""
    ctx.sleep(timedelta(seconds=payload["s"]))
    return ctx.step(stamp, None)


@step("tests.fails_once_then_stamps", retries=1, backoff=timedelta(milliseconds=50))
def fails_once_then_stamps(_: Any) -> float:
    """Fails its first attempt; the retry, due 50 ms later, returns when it began."""
    if current_step().attempt == 1:
        raise RuntimeError("the first attempt fails")
    return time.time()


@workflow("tests.backoff_then_stamp")
def backoff_then_stamp(ctx: Any, _: Any) -> float:
    return ctx.step(fails_once_then_stamps, None)


@workflow("tests.short_debounce", debounce={"key": '"user:" + input.user', "period": timedelta(milliseconds=300)})
def short_debounce(ctx: Any, input: dict[str, Any]) -> float:
    """Begins 0.3 s after its user's last start (tests/processes/test_timers.py: the poller is rung)."""
    return ctx.step(stamp, None)
