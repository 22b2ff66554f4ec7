"""The `rq` transport's lanes: one `RQ_QUEUES` entry it sends work to, with its three priority
tiers, its claim book and doorbell, all on that entry's Redis.

The transport has one lane per entry it uses: `QUEUE` (turns, and steps of every flow-control
queue not routed elsewhere) and each entry `ROUTES` names. Entries on different Redis servers
spread the work over them; a worker serves every lane (`source`), grouped by the Redis each is
on (`server_of`), since one blocking wait can only span the keys of one server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from durable_flow.transports.rq.claims import ClaimBook
from durable_flow.transports.rq.common import HIGH, LOW, NORMAL

if TYPE_CHECKING:
    from redis import Redis
    from rq.queue import Queue

#: What identifies a Redis database: its pool's class, host, port, socket path, database and
#: (Sentinel) service name. Two lanes with the same one are on one server.
Server = tuple[object, ...]


def server_of(connection: Redis) -> Server:
    """The Redis database a client talks to, read from its pool's settings (no round trip)."""
    pool = connection.connection_pool
    kwargs = pool.connection_kwargs
    return (
        type(pool).__name__,
        kwargs.get("host"),
        kwargs.get("port"),
        kwargs.get("path"),
        int(kwargs.get("db") or 0),
        getattr(pool, "service_name", None),
    )


def describe(server: Server) -> str:
    """`host:port/db` (or the socket path, or the Sentinel service) for a log line."""
    _pool, host, port, path, db, service = server
    where = service or path or f"{host}:{port}"
    return f"{where}/{db}"


@dataclass(frozen=True)
class Lane:
    """One `RQ_QUEUES` entry the transport uses: its tiers, claim book and connection."""

    name: str
    tiers: Mapping[str, Queue]
    claims: ClaimBook

    @property
    def connection(self) -> Redis:
        return self.tiers[NORMAL].connection

    @property
    def ordered(self) -> list[Queue]:
        """The tiers in the order a worker pops them: high, normal, low."""
        return [self.tiers[HIGH], self.tiers[NORMAL], self.tiers[LOW]]

    @property
    def server(self) -> Server:
        return server_of(self.connection)

    @classmethod
    def of(cls, name: str, tiers: Mapping[str, Queue]) -> Lane:
        """The lane of these tiers (on one connection), with its claim book."""
        base = tiers[NORMAL]
        tier_keys = [tiers[tier].key for tier in (HIGH, NORMAL, LOW)]
        return cls(name, tiers, ClaimBook(base.connection, name, tier_keys, base.job_class.redis_job_namespace_prefix))


def build_lane(entry: str) -> Lane:
    """The lane of `RQ_QUEUES[entry]`, built without a round trip to Redis.

    A tier listed in `RQ_QUEUES` (`<entry>:high`, `<entry>:low`) is taken from there; otherwise
    it is a plain RQ queue on the base queue's connection, serializer, job class and default
    timeout (django-rq's queue class insists on an `RQ_QUEUES` entry). `manage.py check` makes
    sure a listed tier is on its lane's Redis (`E043`): one script pops all three.
    """
    import django_rq
    from django_rq.settings import QUEUES
    from rq.queue import Queue

    base = django_rq.get_queue(entry, commit_mode="auto")
    tiers: dict[str, Any] = {NORMAL: base}
    for tier in (HIGH, LOW):
        name = f"{entry}:{tier}"
        if name in QUEUES:
            tiers[tier] = django_rq.get_queue(name, commit_mode="auto")
        else:
            tiers[tier] = Queue(
                name,
                connection=base.connection,
                default_timeout=base._default_timeout,
                job_class=base.job_class,
                serializer=base.serializer,
            )
    return Lane.of(entry, tiers)


def configured_server(entry: str) -> Server:
    """The Redis an `RQ_QUEUES` entry names, from its settings alone (no round trip)."""
    from django_rq.connection_utils import get_redis_connection
    from django_rq.settings import QUEUES

    return server_of(get_redis_connection(QUEUES[entry]))
