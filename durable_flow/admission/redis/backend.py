"""Redis admission: one exact cap across every process of the fleet, decided by one Lua script.

Selected with `DURABLE_FLOW["ADMISSION"] = {"BACKEND": "redis", "CONNECTION": "default"}` (a
django-rq `RQ_QUEUES` entry, or `"URL"`); every option is explained in `RedisAdmissionBackend.OPTIONS`.

This module (and `redis` / `django_rq`) is imported only when this backend is selected.

Every decision, release, grant and step start is one `EVALSHA` of `admission.lua` (with
`resources.lua`, step concurrency, in front of it: see `resources`), which
applies exactly the rules of `policy`: a call joins the waiting line and the room there is
(free slots, rate-window room) is granted to the rightful next waiters, best first; a release
grants the freed slot on in the same call. The script reads the server's `TIME` (one clock for
the whole fleet) unless the backend was given an explicit `clock` (tests), whose reading is
passed in.

Key layout (P = `KEY_PREFIX`, Q = queue name). The script touches several keys per call and
looks up other instances' heartbeat keys by name. On Redis Cluster (`CLUSTER`) every P below is
`{P:S}`, the hash tag of the shard S the queue or resource lives in (`shards`), so each call
touches one hash slot: the table is then one shard's, and the instance and fleet keys are kept
per shard (a process beats in each shard it made a call in).

====================  =======  ==============================================================
key                   type     contents
====================  =======  ==============================================================
P:queues              hash     queue name -> `QueueConfig.as_dict()` JSON (`register`)
P:inst:<id>           string   an instance's heartbeat, PX = INSTANCE_TTL_MS, refreshed every
                               ttl/4 by a daemon thread and by every decision it makes
P:fleet               hash     `heard`, `since`: when the server last heard any call, and since
                               when without a silence (`hearing.lua`)
P:q:Q:slots           hash     ticket -> owning instance id (one field per held slot)
P:q:Q:owners          hash     instance id -> slots it holds (the heartbeats to check)
P:q:Q:waiters         hash     ticket -> "priority|arrival|fairness key"
P:q:Q:starts          zset     step starts in the rate window (member unique, score ms)
P:q:Q:fresh           zset     rank index, see below
P:q:Q:grp             zset     rank index (fairness "key"), see below
P:q:Q:gidx            zset     rank index (fairness "key"), see below
P:q:Q:kprio           zset     rank index (fairness "key"), see below
P:q:Q:fkey            zset     rank index (fairness "key"), see below
P:q:Q:served          hash     fairness key -> serve number of its last admission
P:q:Q:meta            hash     counters `arrival`, `serve`, `starts`; `mode` the index was built for
P:q:Q:marks           zset     grants in the rate window (pacing): member serve number, score ms
P:q::...              (as Q)   the pseudo-queue `""` of calls gated by step concurrency alone
P:res:...             various  step-concurrency resources: see `resources.lua`
====================  =======  ==============================================================

Ranking without a scan. The order is `waiter_line.rank`: (-priority, key last served [fairness
"key"; never served = -1], arrival fifo/lifo). The index zsets all have score 0 and members
built from fixed-width decimal fields, so lexicographic order is rank order and "how many
waiters come before me" is a `ZLEXCOUNT` (O(log N)):

- fairness "fifo": `fresh` holds every waiter as `P(priority) A(arrival) ticket`: one
  ZLEXCOUNT per decision.
- fairness "key": the key-served component changes whenever a key is served, and re-scoring
  every waiter of that key on each admission would cost O(waiters of the key), i.e. O(N) for a
  single busy tenant. So waiters of *served* keys live in `grp` grouped by (priority, key) as
  `P KK(key) A ticket`, and `gidx` orders the groups as `P S(served) KK`; a serve re-files the
  key's few `gidx` entries (one per priority it has waiters at, listed in `kprio`), not its
  waiters. Waiters of never-served keys tie at -1 and interleave by arrival, so they stay in
  `fresh` (listed per key in `fkey`) until their key's first serve moves them into `grp`: an
  O(waiters of that key) step paid once per key. A decision counts the waiters ahead of it
  with a few ZLEXCOUNTs plus one per less-recently-served group at its priority, and stops at
  `room` (free slots), so it is O(room * log N) at worst, however many waiters there are.
  The rightful next waiter (what a grant takes) is the first entry of `fresh` or of the first
  `gidx` group, also O(log N).
- Other O(N) paths, all rare: a re-registration that changes `fairness` or `order` rebuilds the
  index (once); reclaiming a dead instance's slots reads the queue's slot hash (bounded by
  `concurrency`); `reoffer` (the poller's safety net) is O(tickets offered).

`P:q:Q:served` keeps one field per fairness key ever served (as the other backends do), so a
queue whose key defaults to the run id grows one small field per run.

Instances. Each backend object has an instance id and heartbeat key. Slots it admits are owned
by it; a live process keeps its slots however long the step runs, and the slots of a process
whose heartbeat lapsed are reclaimed by the next decision on that queue (within INSTANCE_TTL_MS
of its death). The constructor does not touch Redis (a process started during an outage rides it
out): the heartbeat thread beats at once and then every ttl/4, and every script call that makes
this instance an owner refreshes or creates its heartbeat key in the same atomic call, so no
slot is ever owned without a live heartbeat. `register` during an outage keeps the config and
sends it before the next call to Redis.

A lapsed heartbeat is a death only if the live could beat meanwhile. When Redis was down,
restarting or out of reach for longer than what was left of a TTL, every key lapsed, the live
processes' too; so after any silence of half a TTL (no call and no beat from anyone) no slot is
reclaimed until the server has heard the fleet for a whole TTL again (`hearing.lua`), time for
every live process to beat. The price: when the whole fleet was gone (or idle and beating
nowhere), a dead process's slots come back up to one TTL later than that.

`release` removes a slot whoever owns it (results land on any process) and grants it on; the
releasing process dispatches the granted steps. The engine releases a step's slot after its
result commits (`RELEASES_IN_TRANSACTION = False`): a release lost to an outage leaves the
ticket in `slots`, which `held_tickets` lists for the poller's repair (`release_strays`). A process that
forks (e.g. an rq work horse) shares its parent's instance id: the parent's heartbeat keeps the
child's slots alive.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from itertools import islice
from typing import TYPE_CHECKING, Any, ClassVar

from django.core.exceptions import ImproperlyConfigured

from durable_flow.admission.base import (
    AdmissionBackend,
    AdmissionDecision,
    AdmissionRequest,
    Clock,
    Grant,
    OnCount,
    ResourceUsage,
)
from durable_flow.admission.redis import resources as redis_resources
from durable_flow.admission.redis.shards import BRACES, DEFAULT_SHARD, ShardMap, crossing_workflows, shards_problem
from durable_flow.admission.rules.windows import key_start_window, oldest_mark_needed, start_key
from durable_flow.config.options import Option, boolean, non_empty_str, number
from durable_flow.config.queues import QueueConfig, queue_from_dict
from durable_flow.config.validation import HOUR_S
from durable_flow.store.outage import Outage

if TYPE_CHECKING:
    from redis import Redis
    from redis.cluster import RedisCluster

logger = logging.getLogger(__name__)

DEFAULT_INSTANCE_TTL_MS = 15_000
DEFAULT_KEY_PREFIX = "df:adm"
PRIORITY_BOUND = 10**15
"""Priorities are clamped to +-1e15 so the script's fixed-width encoding stays exact."""

_QUEUE_KEYS = (
    "slots",
    "owners",
    "waiters",
    "starts",
    "fresh",
    "grp",
    "gidx",
    "kprio",
    "fkey",
    "served",
    "meta",
    "marks",
)

#: Script ops that may grant a freed step-concurrency resource to a waiter of another queue.
_GRANTING_OPS = frozenset({"admit", "release", "grant"})


def _option_error(key: str, message: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f'DURABLE_FLOW["ADMISSION"]["{key}"]: {message}')


def _redis_url(value: Any) -> str | None:
    if not isinstance(value, str) or not value.startswith(("redis://", "rediss://", "unix://")):
        return f"must be a redis://, rediss:// or unix:// URL, got {value!r}"
    return None


class RedisAdmissionBackend(AdmissionBackend):
    """Fleet-wide admission accounting in Redis. Thread-safe; one instance per process."""

    SUPPORTS_CONSTRAINTS = True  # resources.lua, see the `resources` module
    RELEASES_IN_TRANSACTION = False  # Redis is not the database: released after the commit
    SLOTS_ADOPTED = True  # a slot lives as long as its owner's heartbeat (`adopt`)

    OPTIONS: ClassVar[Mapping[str, Option]] = {
        "CONNECTION": Option("The django-rq RQ_QUEUES entry whose Redis to use (default 'default').", non_empty_str),
        "URL": Option("A redis://, rediss:// or unix:// URL, instead of CONNECTION.", _redis_url),
        "KEY_PREFIX": Option("Prefix of every key, so several deployments can share a Redis.", non_empty_str),
        "INSTANCE_TTL_MS": Option(
            "A dead process's slots are reclaimed within this (ms): 1 to an hour.",
            number(1, HOUR_S * 1000, integer=True, unit="milliseconds"),
        ),
        "CLUSTER": Option(
            "True: URL names a node of a Redis Cluster (redis-py's RedisCluster); every key carries its shard's "
            "hash tag, so each script call touches one hash slot.",
            boolean,
        ),
        "SHARDS": Option(
            "With CLUSTER: {shard: {'QUEUES': [...], 'WORKFLOWS': [...]}}, the queues and workflows (their fn-scope "
            "step concurrency) kept together in one hash slot; the rest live in the 'default' shard.",
            shards_problem,
        ),
    }

    def __init__(
        self,
        connection: Redis | None = None,
        *,
        url: str | None = None,
        clock: Clock | None = None,
        instance_ttl_ms: int = DEFAULT_INSTANCE_TTL_MS,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        handles_cache_s: float = 1.0,
        cluster: bool = False,
        shards: ShardMap | None = None,
    ) -> None:
        """`clock` (epoch ms) replaces the server's `TIME`; give it only in tests, because
        processes whose clocks disagree would disagree about windows and TTLs.

        `cluster`: `url` (or `connection`, a `RedisCluster`) is a Redis Cluster, and every key
        carries the hash tag of its shard (`shards`; see the `shards` module)."""
        import redis
        from redis.cluster import RedisCluster

        if connection is None:
            if url is None:
                raise ValueError("RedisAdmissionBackend needs a connection or a url")
            connection = RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
        self.redis: Redis | RedisCluster = connection
        self.cluster = cluster or isinstance(connection, RedisCluster)
        if self.cluster and any(c in key_prefix for c in BRACES):
            raise ValueError(
                f"a key prefix on Redis Cluster holds no braces (it is in the hash tag), got {key_prefix!r}"
            )
        self.shards = shards or ShardMap()
        self.clock = clock
        self.instance_ttl_ms = instance_ttl_ms
        self.prefix = key_prefix
        self.instance_id = uuid.uuid4().hex
        # The default shard's (on a single Redis, the only ones); see `_heartbeat_keys`.
        self.heartbeat_key, self.fleet_key = self._heartbeat_keys(self._root(DEFAULT_SHARD))
        self._script = self.redis.register_script(redis_resources.script_source())
        self._heartbeat_script = self.redis.register_script(redis_resources.lua("hearing.lua", "heartbeat.lua"))
        # The shards this instance made a call in: it beats in each (a slot it holds there lives
        # as long as those beats). On a single Redis, the one root.
        self._beating: set[str] = set() if self.cluster else {self.prefix}
        self._lock = threading.Lock()
        self._registered: set[str] = set()
        self._known: dict[str, tuple[bool, float]] = {}
        self._handles_cache_s = handles_cache_s
        self._keys: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._heartbeat_value = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        # Registrations not yet stored in Redis (it was down): sent before the next script call.
        self._unsent: dict[str, QueueConfig] = {}
        self._send_lock = threading.Lock()
        # Nothing here touches Redis, so a process built during an outage starts and rides it
        # out. No slot can be owned before the heartbeat is live all the same: every script
        # call that makes this instance an owner refreshes (or creates) its heartbeat key in
        # the same atomic call (`refresh_heartbeat` in admission.lua).
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="df-adm-heartbeat", daemon=True)
        self._heartbeat.start()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RedisAdmissionBackend:
        """Build from `DURABLE_FLOW["ADMISSION"]`; every bad option names its key."""
        cls.check_options(options)
        kwargs: dict[str, Any] = {
            "instance_ttl_ms": options.get("INSTANCE_TTL_MS", DEFAULT_INSTANCE_TTL_MS),
            "key_prefix": options.get("KEY_PREFIX", DEFAULT_KEY_PREFIX),
            "cluster": options.get("CLUSTER", False),
            "shards": ShardMap.from_option(options.get("SHARDS")),
        }
        if "URL" in options:
            return cls(url=options["URL"], **kwargs)
        return cls(_named_connection(options.get("CONNECTION", "default")), **kwargs)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """The declared checks, plus: CONNECTION and URL exclude each other, and CONNECTION (or
        its default, 'default') names an `RQ_QUEUES` entry; nothing connects to Redis."""
        super().check_options(options)
        if "URL" in options and "CONNECTION" in options:
            raise _option_error("URL", "give CONNECTION or URL, not both")
        if options.get("CLUSTER"):
            if "URL" not in options:
                raise _option_error("CLUSTER", "needs URL, a redis:// URL of one node of the cluster")
            prefix = options.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
            if any(c in prefix for c in BRACES):
                raise _option_error(
                    "KEY_PREFIX", f"holds no braces on Redis Cluster (it is in the hash tag), got {prefix!r}"
                )
        elif "SHARDS" in options:
            raise _option_error("SHARDS", "applies to Redis Cluster only: set CLUSTER to True")
        if "URL" not in options:
            _connection_name(options.get("CONNECTION", "default"))

    @classmethod
    def declaration_problems(cls, options: Mapping[str, Any], definitions: Collection[Any]) -> list[str]:
        """On Redis Cluster, the declared shards whose keys would cross hash slots in one call
        (`shards.crossing_workflows`)."""
        if not options.get("CLUSTER") or not options.get("SHARDS"):
            return []
        return crossing_workflows(ShardMap.from_option(options["SHARDS"]), definitions)

    # -- keys ---------------------------------------------------------------------------------
    def _root(self, shard: str) -> str:
        """The prefix of every key of `shard`: on Redis Cluster `{P:S}`, a hash tag, so the
        shard's keys share one hash slot; on a single Redis the key prefix itself (one shard)."""
        return f"{{{self.prefix}:{shard}}}" if self.cluster else self.prefix

    def _heartbeat_keys(self, root: str) -> tuple[str, str]:
        """This instance's heartbeat key and the fleet-hearing hash under `root`."""
        return f"{root}:inst:{self.instance_id}", f"{root}:fleet"

    def _queue_root(self, queue: str) -> str:
        return self._root(self.shards.of_queue(queue))

    def _roots(self, queue: str) -> list[str]:
        """Where calls of `queue` live: its shard's root; for the pseudo-queue `""` (calls gated
        by step concurrency alone) on Redis Cluster, every shard's, since their resources say
        which (a release or a read of `""` goes to each)."""
        if queue or not self.cluster:
            return [self._queue_root(queue)]
        return self._all_roots()

    def _all_roots(self) -> list[str]:
        """Every shard's key root, the default shard's first (on a single Redis, the one prefix)."""
        return list(dict.fromkeys(self._root(shard) for shard in self.shards.names()))

    def queue_keys(self, queue: str, root: str | None = None) -> list[str]:
        """The KEYS of one queue's script call, in the script's order (under `root`, by default
        the queue's shard's)."""
        root = root or self._queue_root(queue)
        keys = self._keys.get(root + "\0" + queue)
        if keys is None:
            base = f"{root}:q:{queue}:"
            keys = [f"{root}:queues", *(base + suffix for suffix in _QUEUE_KEYS), *self._heartbeat_keys(root)]
            self._keys[root + "\0" + queue] = keys
        return keys

    def _run(
        self,
        op: str,
        queue: str,
        ticket: str = "",
        priority: int = 0,
        key: str = "",
        extra: Sequence[Any] = (),
        root: str | None = None,
    ) -> Any:
        if self._unsent:
            self._send_registrations()  # the config first: the script reads it
        root = root or self._queue_root(queue)
        if root not in self._beating:
            with self._lock:
                self._beating.add(root)
        now = "" if self.clock is None else str(int(self.clock()))
        # The ops that may grant a freed resource across queues pass over the paused ones.
        paused = sorted(self.paused_queues()) if op in _GRANTING_OPS else ()
        return self._script(
            keys=self.queue_keys(queue, root),
            args=[
                op,
                queue,
                ticket,
                _bounded(priority),
                key,
                self.instance_id,
                self.instance_ttl_ms,
                json.dumps(paused) if paused else "",
                now,
                f"{root}:inst:",
                "",
                *extra,
            ],
        )

    # -- registration -------------------------------------------------------------------------
    def register(self, config: QueueConfig) -> None:
        """Store the config in Redis, so every process gates the queue the same way. The last
        registration of a name wins fleet-wide; slots, waiters and windows carry over.

        With Redis down, the config is kept and stored before this backend's next call to
        Redis (or the heartbeat's next beat), so an engine can be built during an outage."""
        import redis

        with self._lock:
            self._registered.add(config.name)
            self._known.pop(config.name, None)
            self._unsent[config.name] = config
        try:
            self._send_registrations()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            logger.warning("admission: queue %r registered locally; Redis unavailable (%s)", config.name, exc)

    def _send_registrations(self) -> None:
        """Store the registrations Redis has not got yet. Serialised, so an older config of a
        name never overwrites a newer one sent meanwhile."""
        with self._send_lock:
            with self._lock:
                unsent = dict(self._unsent)
            if not unsent:
                return
            by_root: dict[str, dict[str, str]] = {}
            for name, config in unsent.items():
                by_root.setdefault(self._queue_root(name), {})[name] = json.dumps(config.as_dict())
            for root, mapping in by_root.items():
                self.redis.hset(f"{root}:queues", mapping=mapping)
            with self._lock:
                for name, config in unsent.items():
                    if self._unsent.get(name) is config:
                        del self._unsent[name]

    def handles(self, queue: str) -> bool:
        """Registered here, or by any process (cached for `handles_cache_s`)."""
        with self._lock:
            if queue in self._registered:
                return True
            known = self._known.get(queue)
        if known is not None and known[1] > time.monotonic():
            return known[0]
        exists = bool(self.redis.hexists(f"{self._queue_root(queue)}:queues", queue))
        with self._lock:
            self._known[queue] = (exists, time.monotonic() + self._handles_cache_s)
        return exists

    # -- decisions ----------------------------------------------------------------------------
    def try_admit(self, request: AdmissionRequest) -> AdmissionDecision:
        return self.try_admit_timed(request)[0]

    def try_admit_timed(self, request: AdmissionRequest) -> tuple[AdmissionDecision, int]:
        """The decision and the time (epoch ms) it was made at, as the script saw it: the
        server's clock, so admission logs from several processes line up."""
        reply = self._run(
            "admit",
            request.queue,
            request.ticket,
            request.priority,
            request.key,
            extra=redis_resources.constraint_args(request.constraints),
            root=self._request_root(request),
        )
        now = int(reply[1])
        granted = tuple(_text(t) for t in reply[6:])
        if int(reply[0]) == 1:
            return AdmissionDecision.admit(granted), now
        reason = _text(reply[3])
        held_by = _text(reply[4])
        limits = _told_limits(reply[5])
        full = None
        if reason == "step_concurrency" and held_by.isdigit() and 0 < int(held_by) <= len(request.constraints):
            full = request.constraints[int(held_by) - 1]
        elif reason == "rate_limited" and held_by == "key" and limits is not None:
            limits = replace(limits, rate_limit=None)  # the queue's window had room: the key's held it
        return AdmissionDecision.block(int(reply[2]), reason, granted, limits, full), now  # type: ignore[arg-type]

    def _request_root(self, request: AdmissionRequest) -> str:
        """The root of the one shard a call is decided in (`ShardMap.of_request`)."""
        if not self.cluster:
            return self.prefix
        return self._root(self.shards.of_request(request.queue, request.constraints))

    def release(self, queue: str, ticket: str, *, grant_next: bool = True) -> Grant:
        """Free the ticket's slot whoever owns it, withdraw it as a waiter, and grant the room
        on in the same script call (one per shard for the pseudo-queue on Redis Cluster)."""
        grants = [
            _grant(reply[1], reply[2:])
            for root in self._roots(queue)
            for reply in [self._run("release", queue, ticket, extra=("1" if grant_next else "0",), root=root)]
        ]
        return _merged(grants)

    def grant(self, queue: str) -> Grant:
        grants = [
            _grant(reply[0], reply[1:])
            for root in self._roots(queue)
            for reply in [self._run("grant", queue, root=root)]
        ]
        return _merged(grants)

    def reoffer(self, queue: str, requests: Sequence[AdmissionRequest]) -> list[str]:
        by_root: dict[str, list[AdmissionRequest]] = {}
        for request in requests:
            by_root.setdefault(self._request_root(request), []).append(request)
        held: list[str] = []
        for root, share in by_root.items():
            for start in range(0, len(share), 500):  # bounded script calls, however many are parked
                extra: list[Any] = []
                for request in share[start : start + 500]:
                    extra += redis_resources.reoffer_args(request, _bounded(request.priority))
                held += [_text(t) for t in self._run("reoffer", queue, extra=extra, root=root)]
        return held

    def try_start(self, queue: str, ticket: str, key: str = "", *, on_count: OnCount = None) -> int:
        if on_count is not None:
            on_count()  # the script reads the server's TIME after this: no lock to wait for first
        return self.try_start_timed(queue, ticket, key)[0]

    def try_start_timed(self, queue: str, ticket: str, key: str = "") -> tuple[int, int]:
        """`try_start` and the server time (epoch ms) the start was counted at."""
        wait_ms, now = self._run("start", queue, ticket, key=start_key(ticket, key), root=self._roots(queue)[0])
        return int(wait_ms), int(now)

    def adopt(self, queue: str, ticket: str) -> bool:
        """Make this process the owner of the ticket's slot (it is about to execute the step),
        so the slot lives exactly as long as the execution. False if the slot is gone: its
        owner died and the slot was reclaimed, so the step must go through admission again."""
        return any(int(self._run("adopt", queue, ticket, root=root)) == 1 for root in self._roots(queue))

    def in_flight(self, queue: str) -> int:
        """Slots held now (including those of a dead instance not yet reclaimed)."""
        return sum(int(self._run("inflight", queue, root=root)) for root in self._roots(queue))

    def held_tickets(self, queue: str) -> list[str]:
        """Tickets holding a slot of `queue` (its `slots` hash: bounded by the concurrency;
        `""`, the calls gated by step concurrency alone, by their resources' limits). A
        ticket's step-concurrency slots are freed with its queue slot, in the same script call,
        so a release lost to an outage leaves a ticket here in every case."""
        return [_text(t) for root in self._roots(queue) for t in self.redis.hkeys(f"{root}:q:{queue}:slots")]

    def _stored_config(self, queue: str) -> QueueConfig | None:
        """The queue's config as registered in Redis (what every process decides by)."""
        raw = self.redis.hget(f"{self._queue_root(queue)}:queues", queue)
        return queue_from_dict(json.loads(raw)) if raw else None

    def _now_ms(self) -> int:
        """Now in ms on the server's clock (the script's), or on the injected test clock."""
        if self.clock is not None:
            return int(self.clock())
        seconds, micros = self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def waiting(self, queue: str, limit: int | None = None) -> int:
        """Waiters parked now, by any process (`HLEN` costs the same whatever the line, so
        `limit` is not needed)."""
        return sum(int(self.redis.hlen(f"{root}:q:{queue}:waiters")) for root in self._roots(queue))

    def window_usage(self, queue: str) -> int | None:
        """Step starts in the current rate window, by any process, on the server's clock."""
        config = self._stored_config(queue)
        rate = config.rate_limit if config is not None else None
        if rate is None:
            return None
        start = oldest_mark_needed(rate, self._now_ms())
        return int(self.redis.zcount(f"{self._queue_root(queue)}:q:{queue}:starts", start, "+inf"))

    def resource_usage(self, resources: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Per resource: (slots held, calls waiting), by any process."""
        return redis_resources.resource_usage(
            self.redis, {r: self._root(self.shards.of_resource(r)) for r in resources}
        )

    def constraint_usage(self, prefix: str = "", limit: int = 10) -> list[ResourceUsage]:
        """The busiest step-concurrency resources, by any process (see `resources`)."""
        return redis_resources.constraint_usage(self.redis, self._all_roots(), prefix, limit)

    def key_window_usage(self, queue: str, limit: int, scan: int = 10_000) -> list[tuple[str, int]] | None:
        """The busiest keys of the per-key window, by any process: a SCAN over the queue's live
        per-key start windows (idle ones have expired), at most `scan` of them."""
        config = self._stored_config(queue)
        if config is None or (rate := key_start_window(config)) is None:
            return None
        now = self.clock() if self.clock is not None else int(self.redis.time()[0]) * 1000
        root = f"{self._queue_root(queue)}:q:{queue}:ks:"
        names = list(islice(self.redis.scan_iter(match=_glob_escape(root) + "*", count=1000), scan))
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.zcount(name, oldest_mark_needed(rate, now), "+inf")
        used = [(_text(n)[len(root) :], int(c)) for n, c in zip(names, pipe.execute(), strict=True) if c]
        return sorted(used, key=lambda u: (-u[1], u[0]))[:limit]

    def throttle_usage(self, queue: str, limit: int, scan: int = 10_000) -> list[tuple[str, float]] | None:
        """The throttle's busiest buckets, by any process: a SCAN over the queue's live start-side
        TATs (an idle bucket's key has expired), at most `scan` of them."""
        config = self._stored_config(queue)
        if config is None or config.throttle is None:
            return None
        now = self._now_ms()
        root = f"{self._queue_root(queue)}:q:{queue}:kt:s:"
        names = list(islice(self.redis.scan_iter(match=_glob_escape(root) + "*", count=1000), scan))
        tats = self.redis.mget(names) if names else []
        ahead = [
            (_text(name)[len(root) :], float(tat) - now)
            for name, tat in zip(names, tats, strict=True)
            if tat is not None and float(tat) > now
        ]
        return sorted(ahead, key=lambda a: (-a[1], a[0]))[:limit]

    def keyed_keys(self, queue: str) -> int:
        """Per-key window and throttle keys held for `queue` (the idle-key bench counts them)."""
        root = _glob_escape(f"{self._queue_root(queue)}:q:{queue}:")
        return sum(1 for pattern in ("kw:*", "ks:*", "kt:*") for _ in self.redis.scan_iter(root + pattern, 1000))

    # -- heartbeat ----------------------------------------------------------------------------
    def _beat(self) -> None:
        """Refresh this instance's heartbeat in every shard it made a call in; each shard's
        server counts it as hearing the fleet (`hearing.lua`). A shard that fails is retried at
        the next beat, after the others have beaten."""
        with self._lock:
            roots = sorted(self._beating)
        failed: Exception | None = None
        for root in roots:
            try:
                self._heartbeat_script(
                    keys=list(self._heartbeat_keys(root)), args=[self._heartbeat_value, self.instance_ttl_ms]
                )
            except Exception as exc:  # noqa: BLE001 - raised below, once every other shard has beaten
                failed = exc
        if failed is not None:
            raise failed

    def _heartbeat_loop(self) -> None:
        """Keep this instance's slots alive: refresh the heartbeat every ttl/4, so three missed
        beats still leave it standing, and a server hearing nothing for half a TTL knows it was
        not hearing the fleet (`hearing.lua`). Nothing ends the loop but `close`: a thread that
        died on one bad answer would let this live process's slots lapse and be handed to others
        while its steps still run (a cap breach), so every error is an outage to ride out."""
        import redis

        outage = Outage("admission: instance heartbeat to Redis", logger)
        interval = self.instance_ttl_ms / 4000
        while True:  # beats at once: the constructor does not touch Redis
            try:
                self._beat()
                if self._unsent:
                    self._send_registrations()
            except (redis.RedisError, OSError) as exc:  # down, or not answering as Redis: logged once
                outage.failed(exc)
            except Exception as exc:  # a bug must not stop the beats either; logged with its traceback
                if not outage.failures:
                    logger.exception("admission: instance heartbeat failed; beating on")
                outage.failed(exc)
            else:
                outage.recovered()
            if self._stop.wait(interval):
                return

    def close(self) -> None:
        """Stop the heartbeat thread. The heartbeat key is left to lapse, so
        slots this instance admitted are reclaimed INSTANCE_TTL_MS later, as after a crash."""
        self._stop.set()
        if self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5)


def _bounded(priority: int) -> int:
    """A priority clamped to +-PRIORITY_BOUND, which the script's encoding holds exactly."""
    return max(-PRIORITY_BOUND, min(PRIORITY_BOUND, priority))


def _glob_escape(text: str) -> str:
    """`text` as a literal in a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _told_limits(raw: bytes | str) -> QueueConfig | None:
    """The queue's config a blocked call was decided by, as the script returned it (its
    registered JSON; empty for the pseudo-queue). Only the record of why a call waits depends
    on it, never the decision: a config this code cannot read is told as None."""
    text = _text(raw)
    if not text:
        return None
    try:
        return queue_from_dict(json.loads(text))
    except (ValueError, TypeError):  # bad JSON, InvalidQueueConfig: both ValueErrors
        return None


def _merged(grants: Sequence[Grant]) -> Grant:
    """One shard's grant, or the shards' together: every ticket, the earliest reopening."""
    if len(grants) == 1:
        return grants[0]
    reopens = [g.retry_at_ms for g in grants if g.retry_at_ms is not None]
    return Grant(tuple(t for g in grants for t in g.tickets), min(reopens) if reopens else None)


def _grant(retry_at: bytes | str | int, tickets: Sequence[bytes | str]) -> Grant:
    reopen = _text(retry_at) if not isinstance(retry_at, int) else str(retry_at)
    return Grant(tuple(_text(t) for t in tickets), int(reopen) if reopen else None)


def _connection_name(name: object) -> str:
    """`name` if it is a queue of `settings.RQ_QUEUES`, else `ImproperlyConfigured` (no connection)."""
    from django.conf import settings

    if not isinstance(name, str) or not name:
        raise _option_error("CONNECTION", f"must name an RQ_QUEUES entry, got {name!r}")
    queues = getattr(settings, "RQ_QUEUES", None) or {}
    if name not in queues:
        known = ", ".join(sorted(queues)) or "none defined"
        raise _option_error("CONNECTION", f"{name!r} is not a queue in settings.RQ_QUEUES ({known})")
    return name


def _named_connection(name: object) -> Redis:
    """A connection from django-rq's `RQ_QUEUES[name]`, so Redis is configured in one place."""
    import django_rq

    return django_rq.get_connection(_connection_name(name))
