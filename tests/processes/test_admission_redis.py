"""Fleet proofs for the Redis admission backend, against the real Redis and real processes.

Children are `python -c` processes that call `django.setup()` with `settings.test` and build
the backend from settings-style options (`CONNECTION` = django-rq's "default" queue), then
run `child_main` below. Each test uses its own key prefix and deletes only those keys.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured

from durable_flow.admission.base import AdmissionRequest
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.config.queues import QueueConfig, RateLimit
from durable_flow.testing.clock import FakeClock
from tests.support.redis_admission import REDIS_URL, server_ms

ROOT = Path(__file__).resolve().parents[2]
CHILD = (
    "import sys, django; django.setup();"
    " from tests.processes.test_admission_redis import child_main; child_main(sys.argv[1])"
)


# -- child processes ---------------------------------------------------------------------------
def child_main(raw: str) -> None:
    """Entry point of a child process; `raw` is a JSON dict with `mode` and its parameters."""
    args = json.loads(raw)
    backend = RedisAdmissionBackend.from_options(
        {"CONNECTION": "default", "KEY_PREFIX": args["prefix"], "INSTANCE_TTL_MS": args.get("instance_ttl_ms", 5000)}
    )
    if "clock_ms" in args:  # the parent's FakeClock reading: decide on its time, not the server's
        backend.clock = lambda: int(args["clock_ms"])
    client = backend.redis
    mode = args["mode"]
    if mode == "load":
        _child_load(backend, client, args)
    elif mode == "hold":
        for i in range(args["slots"]):
            assert backend.try_admit(AdmissionRequest(args["queue"], f"held{i}/1")).admitted
        print("ready", flush=True)
        time.sleep(120)
    elif mode == "phantom":
        decision, at = backend.try_admit_timed(AdmissionRequest(args["queue"], "phantom/1", priority=100))
        print(json.dumps({"admitted": decision.admitted, "reason": decision.reason, "at": at}), flush=True)


def _child_load(backend: RedisAdmissionBackend, client: redis.Redis, args: dict[str, Any]) -> None:
    """Threads contend for the capped queue (counting in-flight around each hold) and one thread
    hammers the sliding-window queue, logging each admission's server time. Each runs for
    `duration_s` and, on a slow machine, on until it made its `least` admissions: the test's
    verdicts are on what was admitted, never on how fast."""
    end = time.monotonic() + args["duration_s"]
    least = args.get("least", 0)
    name = args["name"]
    admitted = {"capped": 0, "sliding": 0}
    lock = threading.Lock()

    def capped(thread: int) -> None:
        n = 0
        ticket = ""
        while time.monotonic() < end or n < least:
            ticket = f"{name}-{thread}-{n}/1"
            if backend.try_admit(AdmissionRequest(args["capped"], ticket)).admitted:
                level = client.incr(args["counter"])  # incremented after taking, decremented before giving
                client.rpush(args["levels"], level)
                time.sleep(random.uniform(0.001, 0.006))
                client.decr(args["counter"])
                backend.release(args["capped"], ticket)
                n += 1
                with lock:
                    admitted["capped"] += 1
            else:
                time.sleep(0.001)
        # A call still parked keeps its place (and may be granted a slot meanwhile): withdraw it,
        # as the engine does for a cancelled step.
        backend.release(args["capped"], ticket)

    def sliding() -> None:
        n = 0
        while time.monotonic() < end or n < least:
            ticket = f"{name}-s-{n}/1"
            wait_ms, at = backend.try_start_timed(args["sliding"], ticket)
            if wait_ms == 0:
                client.rpush(args["log"], at)
                n += 1
                with lock:
                    admitted["sliding"] += 1
            else:
                time.sleep(min(wait_ms, 5) / 1000)

    threads = [threading.Thread(target=capped, args=(i,)) for i in range(args["threads"])]
    threads.append(threading.Thread(target=sliding))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(admitted), flush=True)


class Child:
    def __init__(self, args: dict[str, Any]) -> None:
        env = dict(os.environ, DJANGO_SETTINGS_MODULE="settings.test", REDIS_URL=REDIS_URL, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(args)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def readline(self) -> str:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise AssertionError(f"child exited: {self.proc.wait(5)} {self.proc.stderr.read()}")  # type: ignore[union-attr]
        return line.strip()

    def finish(self, timeout: float = 30) -> str:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        return out.strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# -- fixtures (and tests.support.redis_admission) -----------------------------------------------
@pytest.fixture
def make(prefix: str) -> Iterator[Callable[..., RedisAdmissionBackend]]:
    made: list[RedisAdmissionBackend] = []

    def build(**kwargs: Any) -> RedisAdmissionBackend:
        backend = RedisAdmissionBackend(url=REDIS_URL, key_prefix=prefix, **kwargs)
        made.append(backend)
        return backend

    yield build
    for backend in made:
        backend.close()


@pytest.fixture
def children() -> Iterator[Callable[[dict[str, Any]], Child]]:
    started: list[Child] = []

    def start(args: dict[str, Any]) -> Child:
        child = Child(args)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()


def ask(backend: Any, queue: str, ticket: str, **kwargs: Any) -> Any:
    return backend.try_admit(AdmissionRequest(queue=queue, ticket=ticket, **kwargs))


def fleet_since(client: redis.Redis, backend: RedisAdmissionBackend) -> int:
    """Since when (server ms) the server has heard the fleet with no silence (`hearing.lua`)."""
    return int(client.hget(backend.fleet_key, "since") or 0)


# -- settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"CONNECTION": "nope"}, 'DURABLE_FLOW["ADMISSION"]["CONNECTION"]: \'nope\' is not a queue'),
        ({"URL": "http://x"}, 'DURABLE_FLOW["ADMISSION"]["URL"]: must be a redis://'),
        ({"URL": REDIS_URL, "CONNECTION": "default"}, 'DURABLE_FLOW["ADMISSION"]["URL"]: give CONNECTION or URL'),
        ({"INSTANCE_TTL_MS": 0}, 'DURABLE_FLOW["ADMISSION"]["INSTANCE_TTL_MS"]: must be an integer from 1 to 3600000'),
        ({"KEY_PREFIX": ""}, 'DURABLE_FLOW["ADMISSION"]["KEY_PREFIX"]: must be a non-empty string'),
        ({"HOST": "x"}, 'DURABLE_FLOW["ADMISSION"]: unknown option(s) HOST'),
    ],
)
def test_bad_options_name_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ImproperlyConfigured) as error:
        RedisAdmissionBackend.from_options(options)
    assert message in str(error.value)


def test_from_options_uses_the_named_rq_connection_and_registrations_reach_every_process(prefix: str) -> None:
    first = RedisAdmissionBackend.from_options({"CONNECTION": "durable", "KEY_PREFIX": prefix})
    second = RedisAdmissionBackend.from_options({"URL": REDIS_URL, "KEY_PREFIX": prefix, "INSTANCE_TTL_MS": 3000})
    try:
        assert (
            first.redis.connection_pool.connection_kwargs["db"] == second.redis.connection_pool.connection_kwargs["db"]
        )
        assert second.instance_ttl_ms == 3000 and first.instance_id != second.instance_id
        assert not second.handles("shared")
        first.register(QueueConfig(name="shared", concurrency=1))
        second._known.clear()  # skip the 1 s negative cache
        assert second.handles("shared")
        assert ask(first, "shared", "a/1").admitted
        assert ask(second, "shared", "b/1").reason == "concurrency"  # one cap across both
        second.release("shared", "a/1")  # a result may land on another process
        assert ask(second, "shared", "b/1").admitted
    finally:
        first.close()
        second.close()


# -- the rulebook, against policy.decide -------------------------------------------------------
def test_changing_fairness_and_order_rebuilds_the_line(make: Callable[..., RedisAdmissionBackend]) -> None:
    backend = make(clock=FakeClock())
    backend.register(QueueConfig(name="q", concurrency=1))
    assert ask(backend, "q", "holder/1", fairness_key="H").admitted
    for ticket, key in (("a/1", "A"), ("b/1", "B"), ("c/1", "A")):
        assert not ask(backend, "q", ticket, fairness_key=key).admitted
    backend.register(QueueConfig(name="q", concurrency=1, fairness="key", order="lifo"))
    backend.release("q", "holder/1")
    # A, B never served: they tie and lifo picks the newest, c; then B (never served) beats A.
    assert not ask(backend, "q", "a/1", fairness_key="A").admitted
    assert not ask(backend, "q", "b/1", fairness_key="B").admitted
    assert ask(backend, "q", "c/1", fairness_key="A").admitted
    backend.release("q", "c/1")
    assert not ask(backend, "q", "a/1", fairness_key="A").admitted
    assert ask(backend, "q", "b/1", fairness_key="B").admitted


def test_a_busy_key_does_not_cost_a_scan_per_decision(
    make: Callable[..., RedisAdmissionBackend], redis_client: redis.Redis
) -> None:
    """5,000 waiters of one tenant behind 1 of another: re-serving the busy tenant re-files one
    group, and the other tenant still wins its turn (fairness="key" at scale). Every decision and
    release costs the script a few commands on a few elements, however many waiters the busy
    tenant has: counted from what Redis's MONITOR shows the script doing, not from a stopwatch."""
    backend = make(clock=FakeClock())
    backend.register(QueueConfig(name="q", concurrency=1, fairness="key"))
    assert ask(backend, "q", "first/1", fairness_key="busy").admitted
    pipe = backend.redis.pipeline(transaction=False)
    for i in range(5_000):
        backend._script(keys=backend.queue_keys("q"), args=_admit_args(backend, f"b{i}/1", "busy"), client=pipe)
    pipe.execute()
    assert not ask(backend, "q", "quiet/1", fairness_key="quiet").admitted
    watch = partial(script_cost, redis_client, backend.prefix)
    assert watch(partial(backend.release, "q", "first/1")).tickets == ("quiet/1",)  # quiet was never served
    assert not watch(partial(ask, backend, "q", "b2500/1", fairness_key="busy")).admitted
    assert ask(backend, "q", "quiet/1", fairness_key="quiet").admitted
    assert watch(partial(backend.release, "q", "quiet/1")).tickets == ("b0/1",)  # re-serves busy
    assert ask(backend, "q", "b0/1", fairness_key="busy").admitted
    for n in range(1, 4):  # busy is re-served each time: no rewrite of its 5,000 waiters
        assert watch(partial(backend.release, "q", f"b{n - 1}/1")).tickets == (f"b{n}/1",)
        assert not watch(partial(ask, backend, "q", "b4000/1", fairness_key="busy")).admitted


#: At most this many Redis commands, and elements read or written, per call of the admission
#: script in `test_a_busy_key_does_not_cost_a_scan_per_decision`, far below the busy tenant's 5,000 waiters.
SCRIPT_COST_BOUND = 100
#: Commands that read or rewrite a whole structure: they touch as many elements as it held.
WHOLE_STRUCTURE = {
    "HGETALL", "HKEYS", "HVALS", "SMEMBERS", "DEL", "UNLINK", "RENAME", "COPY", "DUMP", "RESTORE", "SORT",
    "ZRANGESTORE", "ZUNIONSTORE", "ZINTERSTORE", "ZDIFFSTORE", "ZUNION", "ZINTER", "ZDIFF", "HSCAN", "ZSCAN",
    "SSCAN", "SCAN", "KEYS",
}  # fmt: skip
_MONITOR_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def _monitor_args(line: bytes) -> list[bytes]:
    """The arguments of one MONITOR line (Redis quotes each and escapes it like `sdscatrepr`)."""
    args = []
    for quoted in _MONITOR_ARG.findall(line.split(b"] ", 1)[1]):
        out, i = bytearray(), 0
        while i < len(quoted):
            if quoted[i : i + 1] == b"\\" and quoted[i + 1 : i + 2] == b"x":
                out += bytes([int(quoted[i + 2 : i + 4], 16)])
                i += 4
            elif quoted[i : i + 1] == b"\\":
                out += _ESCAPES.get(quoted[i + 1 : i + 2], quoted[i + 1 : i + 2])
                i += 2
            else:
                out += quoted[i : i + 1]
                i += 1
        args.append(bytes(out))
    return args


def _sizes(client: redis.Redis, prefix: str) -> dict[bytes, int]:
    """How many elements each key under `prefix` holds."""
    size = {b"zset": client.zcard, b"hash": client.hlen, b"set": client.scard, b"list": client.llen}
    return {
        key: size[kind](key) if (kind := client.type(key)) in size else 1
        for key in client.scan_iter(match=f"{prefix}:*", count=1000)
    }


def _elements(client: redis.Redis, args: list[bytes], before: dict[bytes, int], after: dict[bytes, int]) -> int:
    """How many elements one command of the script read or wrote (an upper bound)."""
    name = args[0].upper().decode()
    if name in WHOLE_STRUCTURE:
        return sum(before.get(key, 0) for key in args[1:]) or 1
    if b"LIMIT" in (arg.upper() for arg in args):
        return int(args[-1])
    if name in ("ZRANGEBYLEX", "ZREVRANGEBYLEX"):
        low, high = (args[2], args[3]) if name == "ZRANGEBYLEX" else (args[3], args[2])
        return int(client.zlexcount(args[1], low, high))  # the range's size once the call is over
    if name.startswith("ZREMRANGEBY") or name in ("ZRANGE", "ZREVRANGE", "ZRANGEBYSCORE", "ZREVRANGEBYSCORE"):
        return max(before.get(args[1], 0), after.get(args[1], 0))  # could have been the whole set
    return max(1, len(args) - 2)


def script_cost(client: redis.Redis, prefix: str, call: Callable[[], Any]) -> Any:
    """Run `call` (one call of the admission script) under MONITOR and assert that the commands
    the script ran, and the elements they read or wrote, stay under `SCRIPT_COST_BOUND`."""
    before = _sizes(client, prefix)
    sentinel = f"end-of-{uuid.uuid4().hex}".encode()
    db = client.connection_pool.connection_kwargs.get("db", 0)
    monitor = client.monitor()
    with monitor:
        result = call()
        client.echo(sentinel)
        commands = []
        while sentinel not in (line := monitor.connection.read_response()):
            if f"[{db} lua]".encode() in line:
                commands.append(_monitor_args(line))
    after = _sizes(client, prefix)
    costs = sorted(((_elements(client, args, before, after), args) for args in commands), reverse=True)
    assert commands and len(commands) <= SCRIPT_COST_BOUND, f"{len(commands)} commands: {commands[:5]}..."
    assert sum(cost for cost, _ in costs) <= SCRIPT_COST_BOUND, f"the costliest: {costs[:3]}"
    return result


def _admit_args(backend: RedisAdmissionBackend, ticket: str, key: str) -> list[Any]:
    now = str(backend.clock()) if backend.clock else ""
    return [
        "admit",
        "q",
        ticket,
        0,
        key,
        backend.instance_id,
        backend.instance_ttl_ms,
        "",
        now,
        f"{backend.prefix}:inst:",
        "",
    ]


# -- server time -------------------------------------------------------------------------------
def test_without_a_clock_the_server_time_decides(
    make: Callable[..., RedisAdmissionBackend], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make()
    skew_s = 86_400
    real_time, real_time_ns = time.time, time.time_ns
    monkeypatch.setattr(time, "time", lambda: real_time() + skew_s)
    monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + skew_s * 10**9)
    backend.register(QueueConfig(name="q", concurrency=1, retry_ms=700))
    assert ask(backend, "q", "a/1").admitted
    before = server_ms(redis_client)
    blocked = ask(backend, "q", "b/1")
    after = server_ms(redis_client)
    assert blocked.reason == "concurrency"
    assert before + 700 <= blocked.retry_at_ms <= after + 700
    assert abs(blocked.retry_at_ms - (time.time_ns() // 1_000_000 + 700)) > 3_600_000  # not the skewed clock


# -- fleet proofs ------------------------------------------------------------------------------
def test_four_processes_never_exceed_the_cap_or_the_sliding_window(
    prefix: str, redis_client: redis.Redis, make: Callable[..., RedisAdmissionBackend], children: Callable[..., Child]
) -> None:
    observer = make()
    observer.register(QueueConfig(name="capped", concurrency=5, retry_ms=5))
    limit, period = 20, 300
    observer.register(
        QueueConfig(name="sliding", rate_limit=RateLimit(limit=limit, period_ms=period, algorithm="sliding"))
    )
    common = {
        "prefix": prefix,
        "mode": "load",
        "duration_s": 2.5,
        "least": 20,  # per thread: 4 processes x 3 threads x 20 > 200 capped, 4 x 20 > 2 x limit sliding
        "threads": 3,
        "capped": "capped",
        "sliding": "sliding",
        "counter": f"{prefix}:test:counter",
        "levels": f"{prefix}:test:levels",
        "log": f"{prefix}:test:log",
    }
    procs = [children({**common, "name": f"p{i}"}) for i in range(4)]
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:  # an independent view: the slot hash itself, read continuously
        while not done.is_set():
            samples.append(observer.in_flight("capped"))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        # A wait for the children to end, not a verdict: they start slowly on a busy machine.
        results = [json.loads(proc.finish(timeout=180)) for proc in procs]
    finally:
        done.set()
        sampler.join()

    levels = [int(x) for x in redis_client.lrange(common["levels"], 0, -1)]
    assert len(levels) == sum(r["capped"] for r in results) > 200
    assert all(r["capped"] > 10 for r in results)  # every process got its share
    assert max(levels) == 5  # contended up to the cap, never past it
    assert len(samples) > 200 and max(samples) <= 5 and 5 in samples
    assert observer.in_flight("capped") == 0

    times = sorted(int(x) for x in redis_client.lrange(common["log"], 0, -1))
    violations = [i for i in range(len(times) - limit) if times[i + limit] - times[i] < period]
    assert not violations, f"{limit + 1} admissions within {period} ms at {times[violations[0]]}"
    # And the window reopens under load (its rate against the limit is bench/contention.py's).
    assert len(times) > 2 * limit


def test_a_killed_process_slots_are_reclaimed_within_the_instance_ttl(
    prefix: str, redis_client: redis.Redis, make: Callable[..., RedisAdmissionBackend], children: Callable[..., Child]
) -> None:
    ttl = 4000  # beats every ttl/4: a busy machine has three seconds of slack before a live holder lapses
    backend = make(instance_ttl_ms=ttl)
    backend.register(QueueConfig(name="q", concurrency=3, retry_ms=10))
    holder = children({"prefix": prefix, "mode": "hold", "queue": "q", "slots": 3, "instance_ttl_ms": ttl})
    assert holder.readline() == "ready"
    assert ask(backend, "q", "mine/1").reason == "concurrency"
    time.sleep(2.5 * ttl / 1000)  # a live process keeps its slots however long its steps run
    assert ask(backend, "q", "mine/1").reason == "concurrency"
    assert backend.in_flight("q") == 3

    dead = [owner for owner in redis_client.hkeys(f"{prefix}:q:q:owners") if owner.decode() != backend.instance_id]
    assert len(dead) == 1
    heartbeat = f"{prefix}:inst:{dead[0].decode()}"
    os.kill(holder.proc.pid, signal.SIGKILL)
    holder.proc.wait(10)
    assert redis_client.pttl(heartbeat) <= ttl  # Redis expires it at most one TTL after the last beat
    # The verdict rides on the heartbeat key itself and on the server's record of hearing the
    # fleet, not on how promptly this process polls: the slots stay held while the key lives and
    # are reclaimed by the first decision after it lapses, unless a silence (this busy machine's
    # late beats) left the server hearing the fleet for less than a TTL (`hearing.lua`).
    deadline = time.monotonic() + 30
    while True:
        alive, before_ms = redis_client.exists(heartbeat), server_ms(redis_client)
        decision = ask(backend, "q", "mine/1")
        if decision.admitted:
            assert not redis_client.exists(heartbeat), "slots reclaimed while their owner was alive"
            break
        assert decision.reason == "concurrency"
        heard_ms = before_ms - fleet_since(redis_client, backend)  # at least this long at the decision
        assert alive or heard_ms < ttl, "the dead process's heartbeat lapsed but its slots were not reclaimed"
        assert time.monotonic() < deadline, "the dead process's heartbeat never lapsed"
        time.sleep(0.01)
    assert backend.in_flight("q") == 1  # the three dead slots are gone, ours is held


def test_a_waiter_left_by_a_dead_process_is_granted_and_can_be_handed_on(
    prefix: str, make: Callable[..., RedisAdmissionBackend], children: Callable[..., Child]
) -> None:
    """Waiters never expire: a parked call keeps its place however long it waits. One whose
    process died is granted like any other; the engine, finding no waiting checkpoint for it,
    releases the grant and the room passes to the next waiter in the same call."""
    clock = FakeClock()
    backend = make(clock=clock)
    backend.register(QueueConfig(name="q", concurrency=1, retry_ms=10))
    assert ask(backend, "q", "holder/1").admitted
    phantom = json.loads(children({"prefix": prefix, "mode": "phantom", "queue": "q", "clock_ms": clock()}).finish())
    assert (phantom["admitted"], phantom["reason"], phantom["at"]) == (False, "concurrency", clock())
    assert not ask(backend, "q", "live/1").admitted
    clock.advance(3_600_000)  # an hour later the phantom is still first in line
    assert backend.release("q", "holder/1").tickets == ("phantom/1",)
    assert backend.release("q", "phantom/1").tickets == ("live/1",)
