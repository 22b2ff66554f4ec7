"""The `redis` admission backend on a real three-master Redis Cluster (`redis_cluster`), beyond the
contract kit (which runs there too): declared shards put queues on their own hash slots, one call
never leaves its shard, the pseudo-queue and the read model span the shards, a dead process's
slots are reclaimed in each shard it held them in, and `manage.py check` refuses a declaration
whose keys would cross slots. The failover under load is `test_admission_redis_cluster_failover`."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis.cluster import RedisCluster

from durable_flow.admission.base import AdmissionRequest, Constraint
from durable_flow.admission.redis.backend import RedisAdmissionBackend
from durable_flow.admission.redis.shards import ShardMap
from durable_flow.config.queues import QueueConfig
from durable_flow.exceptions import AdmissionShardError
from durable_flow.testing.clock import FakeClock
from tests.support.redis_admission import closing, server_ms
from tests.support.redis_cluster import OwnCluster
from tests.support.redis_keys import delete_keys

Make = Callable[..., RedisAdmissionBackend]


@pytest.fixture
def client(redis_cluster: OwnCluster) -> Iterator[RedisCluster]:
    connection = RedisCluster.from_url(redis_cluster.url)
    yield connection
    connection.close()


@pytest.fixture
def prefix(client: RedisCluster) -> Iterator[str]:
    value = f"test:adm:{uuid.uuid4().hex[:12]}"
    yield value
    delete_keys(client, f"{{{value}:*")


@pytest.fixture
def make(redis_cluster: OwnCluster, prefix: str) -> Iterator[Make]:
    clock = FakeClock()

    def build(shards: dict[str, Any] | None = None) -> RedisAdmissionBackend:
        return RedisAdmissionBackend(
            url=redis_cluster.url, cluster=True, clock=clock, key_prefix=prefix, shards=ShardMap.from_option(shards)
        )

    yield from closing(build)


def ask(backend: RedisAdmissionBackend, ticket: str, *constraints: Constraint, queue: str = "", **kw: Any) -> Any:
    return backend.try_admit(AdmissionRequest(queue=queue, ticket=ticket, constraints=constraints, **kw))


#: Two declared shards, each a queue and a workflow; the rest lives in `default`.
SHARDS = {"a": {"QUEUES": ["qa"], "WORKFLOWS": ["wf-a"]}, "b": {"QUEUES": ["qb"], "WORKFLOWS": ["wf-b"]}}


def slot_of(client: RedisCluster, key: str) -> int:
    return int(client.keyslot(key))


def test_declared_shards_keep_each_queue_and_its_workflows_resources_in_one_slot(
    make: Make, client: RedisCluster, prefix: str
) -> None:
    backend = make(SHARDS)
    backend.register(QueueConfig(name="qa", concurrency=1))
    backend.register(QueueConfig(name="qb", concurrency=1))
    backend.register(QueueConfig(name="qd", concurrency=1))  # undeclared: the default shard
    assert ask(backend, "a1/1", Constraint("sc:fn:wf-a:k", 5), queue="qa").admitted
    assert ask(backend, "b1/1", Constraint("sc:fn:wf-b", 5), queue="qb").admitted
    assert ask(backend, "d1/1", queue="qd").admitted
    slots: dict[str, set[int]] = {}
    for key in client.scan_iter(match=f"{{{prefix}:*", count=1000):
        name = key.decode()
        slots.setdefault(name[len(prefix) + 2 : name.index("}")], set()).add(slot_of(client, name))
    # Every key of a shard in one slot, each shard its own (three tags, three slots).
    assert {shard: len(s) for shard, s in slots.items()} == {"a": 1, "b": 1, "default": 1}
    assert len(set().union(*slots.values())) == 3
    # The queues are gated as on one Redis: each at its own cap.
    assert not ask(backend, "a2/1", queue="qa").admitted
    assert backend.release("qa", "a1/1").tickets == ("a2/1",)
    assert backend.in_flight("qa") == 1 and backend.in_flight("qb") == 1 and backend.in_flight("qd") == 1


def test_a_call_whose_queue_and_resource_are_in_two_shards_is_refused(make: Make) -> None:
    backend = make(SHARDS)
    backend.register(QueueConfig(name="qa", concurrency=1))
    with pytest.raises(AdmissionShardError, match="queue 'qa' is in shard 'a' but resource 'sc:fn:wf-b:x'"):
        ask(backend, "x/1", Constraint("sc:fn:wf-b:x", 1), queue="qa")
    with pytest.raises(AdmissionShardError, match="in shard 'default'"):
        ask(backend, "y/1", Constraint("sc:acct:acme", 1), queue="qa")  # account scope: the default shard
    assert backend.in_flight("qa") == 0  # nothing was taken


def test_the_pseudo_queue_lives_in_each_shard_and_a_release_finds_its_ticket(make: Make) -> None:
    """Calls gated by step concurrency alone are decided in their resource's shard; a release of
    the pseudo-queue (which names no shard) reaches the shard that holds the ticket and grants
    its waiter there."""
    admitting, releasing = make(SHARDS), make(SHARDS)
    in_b, in_default = Constraint("sc:fn:wf-b:k", 1), Constraint("sc:fn:other", 1)
    assert ask(admitting, "h/1", in_b).admitted and ask(admitting, "d/1", in_default).admitted
    assert not ask(admitting, "w/1", in_b).admitted
    assert sorted(releasing.held_tickets("")) == ["d/1", "h/1"]
    assert releasing.waiting("") == 1
    assert releasing.release("", "h/1").tickets == ("w/1",)
    assert releasing.adopt("", "w/1")
    assert releasing.resource_usage([in_b.resource, in_default.resource]) == {
        in_b.resource: (1, 0),
        in_default.resource: (1, 0),
    }
    usage = {u.resource: (u.active, u.waiting) for u in releasing.constraint_usage("sc:fn:")}
    assert usage == {in_b.resource: (1, 0), in_default.resource: (1, 0)}


def test_a_dead_process_slots_are_reclaimed_in_every_shard_it_held_them_in(
    make: Make, client: RedisCluster, prefix: str
) -> None:
    dying, alive = make(SHARDS), make(SHARDS)
    for queue in ("qa", "qb"):
        alive.register(QueueConfig(name=queue, concurrency=1))
        assert ask(dying, f"{queue}-d/1", queue=queue).admitted
        assert not ask(alive, f"{queue}-w/1", queue=queue).admitted
    # The process dies: its beats stop and its heartbeat key lapses in each shard, while each
    # shard's server kept hearing the rest of the fleet for a TTL (`hearing.lua`).
    dying.close()
    for shard in ("a", "b"):
        root = f"{{{prefix}:{shard}}}"
        client.delete(f"{root}:inst:{dying.instance_id}")
        now = server_ms(client)
        client.hset(f"{root}:fleet", mapping={"heard": now, "since": now - dying.instance_ttl_ms})
    for queue in ("qa", "qb"):
        assert alive.grant(queue).tickets == (f"{queue}-w/1",)


def test_an_instance_beats_in_each_shard_it_made_a_call_in(make: Make, client: RedisCluster, prefix: str) -> None:
    backend = make(SHARDS)
    backend.register(QueueConfig(name="qb", concurrency=1))
    assert ask(backend, "b/1", queue="qb").admitted
    backend._beat()
    assert client.exists(f"{{{prefix}:b}}:inst:{backend.instance_id}")
    assert not client.exists(f"{{{prefix}:a}}:inst:{backend.instance_id}")  # no call there: no beat


# -- manage.py check ------------------------------------------------------------------------------
def cluster_admission(**options: Any) -> dict[str, Any]:
    return {"ADMISSION": {"BACKEND": "redis", "URL": "redis://unreachable.invalid:7100/0", "CLUSTER": True, **options}}


def reported(durable_flow: dict[str, Any]) -> list[Any]:
    from django.test import override_settings

    from durable_flow.checks import check_settings
    from durable_flow.config.settings import reset_settings

    with override_settings(DURABLE_FLOW=durable_flow):
        reset_settings()
        try:
            return [m for m in check_settings() if not m.is_silenced()]
        finally:
            reset_settings()


def test_check_refuses_a_workflow_placed_in_a_shard_with_account_scope_concurrency() -> None:
    """`sc.two` (tests/sc_workflows.py) declares an account-scope constraint, whose resources live
    in the default shard, and a fn-scope one, which its shard would take: one call, two slots."""
    errors = reported(cluster_admission(SHARDS={"llm": {"QUEUES": ["openai"], "WORKFLOWS": ["sc.two"]}}))
    assert [e.id for e in errors] == ["durable_flow.E030"]
    assert "workflow 'sc.two' is in shard 'llm' but declares account-scope step concurrency" in errors[0].msg
    assert errors[0].hint


def test_check_takes_a_shard_of_fn_scope_workflows_and_their_queues() -> None:
    assert reported(cluster_admission(SHARDS={"llm": {"QUEUES": ["openai"], "WORKFLOWS": ["sc.per_account"]}})) == []


@pytest.mark.parametrize(
    ("admission", "message"),
    [
        (
            {"BACKEND": "redis", "URL": "redis://h:1/0", "SHARDS": {"a": {"QUEUES": ["q"]}}},
            '["SHARDS"]: applies to Redis Cluster only',
        ),
        ({"BACKEND": "redis", "CLUSTER": True}, '["CLUSTER"]: needs URL'),
        ({"BACKEND": "redis", "URL": "redis://h:1/0", "CLUSTER": "yes"}, '["CLUSTER"]: must be True or False'),
        (
            {"BACKEND": "redis", "URL": "redis://h:1/0", "CLUSTER": True, "KEY_PREFIX": "df{x}"},
            '["KEY_PREFIX"]: holds no braces on Redis Cluster',
        ),
        (
            {
                "BACKEND": "redis",
                "URL": "redis://h:1/0",
                "CLUSTER": True,
                "SHARDS": {"a": {"QUEUES": ["q"]}, "b": {"QUEUES": ["q"]}},
            },
            "queue 'q' is in two shards, 'a' and 'b'",
        ),
        (
            {"BACKEND": "redis", "URL": "redis://h:1/0", "CLUSTER": True, "SHARDS": {"{a}": {"QUEUES": ["q"]}}},
            "shard names are non-empty strings without braces",
        ),
        (
            {"BACKEND": "redis", "URL": "redis://h:1/0", "CLUSTER": True, "SHARDS": {"a": {"QUEUE": ["q"]}}},
            "unknown field(s) QUEUE",
        ),
    ],
)
def test_check_refuses_malformed_cluster_options(admission: dict[str, Any], message: str) -> None:
    errors = reported({"ADMISSION": admission})
    assert [e.id for e in errors] == ["durable_flow.E004"]
    assert message in errors[0].msg and errors[0].hint


# -- what a failover can lose -------------------------------------------------------------------
class LostWrites:
    """What a promoted replica lacks: the shard's keys as they were before some acknowledged
    writes (asynchronous replication). `snapshot` them, let calls run, then `lose` what those
    calls wrote: the keys go back to the snapshot, as on a replica that never received them."""

    def __init__(self, client: RedisCluster, root: str) -> None:
        self.client, self.root = client, root
        self.saved: dict[bytes, tuple[bytes, int]] = {}

    def snapshot(self) -> None:
        names = list(self.client.scan_iter(match=f"{self.root}:*", count=1000))
        self.saved = {n: (self.client.dump(n), self.client.pttl(n)) for n in names}

    def lose(self) -> None:
        names = list(self.client.scan_iter(match=f"{self.root}:*", count=1000))
        for name in names:
            self.client.delete(name)
        for name, (value, ttl) in self.saved.items():
            self.client.restore(name, max(ttl, 0), value, replace=True)


@pytest.fixture
def lost(client: RedisCluster, prefix: str) -> LostWrites:
    return LostWrites(client, f"{{{prefix}:default}}")


def test_a_lost_grant_is_caught_by_adopt_and_the_call_goes_back_in_line(make: Make, lost: LostWrites) -> None:
    backend = make()
    backend.register(QueueConfig(name="q", concurrency=1))
    assert ask(backend, "h/1", queue="q").admitted and backend.adopt("q", "h/1")
    assert not ask(backend, "w/1", queue="q").admitted
    lost.snapshot()
    assert backend.release("q", "h/1").tickets == ("w/1",)  # acknowledged...
    lost.lose()  # ...and lost: the new master still has h holding the slot, w waiting
    assert not backend.adopt("q", "w/1")  # the executing process finds no slot: the step is not run
    # The release is lost too: h is a settled call still holding its slot, which the poller's
    # repair releases again (`held_tickets`), granting w once more.
    assert backend.held_tickets("q") == ["h/1"]
    assert backend.release("q", "h/1").tickets == ("w/1",)
    assert backend.adopt("q", "w/1")


def test_a_lost_waiter_is_put_back_by_reoffer_keeping_no_one_out(make: Make, lost: LostWrites) -> None:
    backend = make()
    backend.register(QueueConfig(name="q", concurrency=1))
    assert ask(backend, "h/1", queue="q").admitted
    lost.snapshot()
    assert not ask(backend, "w/1", queue="q").admitted  # parked, then lost
    lost.lose()
    assert backend.waiting("q") == 0
    assert backend.reoffer("q", [AdmissionRequest(queue="q", ticket="w/1")]) == []  # the safety net re-parks it
    assert backend.release("q", "h/1").tickets == ("w/1",)


def test_a_lost_admission_of_a_running_step_is_the_one_breach_a_failover_can_cause(
    make: Make, lost: LostWrites
) -> None:
    """The step was admitted and adopted on the old master, which the replica never heard of: the
    new master counts its slot free, so one more call is admitted while it runs. The cap is
    exceeded by the admissions lost, for as long as those steps run; nothing in Redis can tell."""
    backend = make()
    backend.register(QueueConfig(name="q", concurrency=1))
    lost.snapshot()
    assert ask(backend, "a/1", queue="q").admitted and backend.adopt("q", "a/1")  # a runs
    lost.lose()
    assert backend.held_tickets("q") == []
    assert ask(backend, "b/1", queue="q").admitted  # b runs beside a: 2 > 1
    backend.release("q", "a/1")  # a ends: its release frees nothing, b's slot is kept
    assert backend.held_tickets("q") == ["b/1"]
    assert not ask(backend, "c/1", queue="q").admitted  # the cap holds again
