"""Per-key rate windows and the throttle: bad shapes refused at startup naming the queue and the
option, and idle keys leaving no state behind on every backend (the contract kit,
`durable_flow.testing.keyed_contract`, holds the admission rules themselves)."""

from __future__ import annotations

import os
import re
import time
import uuid
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from durable_flow.admission.base import AdmissionBackend, AdmissionRequest
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.admission.db.keyed import rows
from durable_flow.admission.local import LocalAdmissionBackend
from durable_flow.admission.rules.keyed import throttle_standing
from durable_flow.config.queues import QueueConfig, RateLimit, Throttle, queue_from_dict
from durable_flow.config.settings import parse_settings
from durable_flow.testing.clock import FakeClock
from tests.support.redis_keys import delete_keys

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
PER_KEY = {"limit": 10, "period_ms": 1000, "per": "key", "algorithm": "sliding"}


@pytest.mark.parametrize(
    ("queue", "names"),
    [
        ({"rate_limit": [PER_KEY, PER_KEY]}, "'q'.rate_limit[1]: at most one key window"),
        ({"rate_limit": [{"limit": 1, "period_ms": 1}] * 2}, "'q'.rate_limit[1]: at most one global window"),
        ({"rate_limit": [PER_KEY] * 3}, "'q'.rate_limit: expected a dict with limit and period_ms, or a list"),
        ({"rate_limit": []}, "'q'.rate_limit: expected"),
        ({"rate_limit": {**PER_KEY, "per": "tenant"}}, "'q'.rate_limit.per: must be 'global' or 'key'"),
        ({"rate_limit": [{**PER_KEY, "limit": 0}]}, "'q'.rate_limit[0].limit"),
        ({"throttle": {"limit": 100, "period_ms": 60_000, "burst": 0}}, "'q'.throttle.burst"),
        ({"throttle": {"limit": 100, "period_ms": 0}}, "'q'.throttle.period_ms"),
        ({"throttle": {"period_ms": 1000}}, "'q'.throttle.limit"),
        ({"throttle": {"limit": 1, "period_ms": 1, "per": "run"}}, "'q'.throttle.per"),
        ({"throttle": {"limit": 1, "period_ms": 1, "rate": 2}}, "'q'.throttle: unknown option(s) rate"),
        ({"throttle": [1, 2]}, "'q'.throttle: expected a dict with limit, period_ms and burst"),
    ],
)
def test_a_bad_per_key_window_or_throttle_is_refused_at_startup_naming_queue_and_option(
    queue: dict[str, Any], names: str
) -> None:
    with pytest.raises(ImproperlyConfigured) as info:
        parse_settings({"QUEUES": [{"name": "q", **queue}]})
    assert 'DURABLE_FLOW["QUEUES"][0]' in str(info.value) and names in str(info.value)


def test_a_global_and_a_per_key_window_and_a_throttle_parse_and_round_trip() -> None:
    raw = {
        "name": "q",
        "rate_limit": [{"limit": 100, "period_ms": 1000}, PER_KEY],
        "throttle": {"limit": 100, "period_ms": 60_000, "burst": 10, "per": "key"},
    }
    (config,) = parse_settings({"QUEUES": [raw]}).queues
    assert config.rate_limit == RateLimit(100, 1000)
    assert config.key_rate_limit == RateLimit(10, 1000, "sliding")
    assert config.throttle == Throttle(100, 60_000, burst=10, per="key")
    assert queue_from_dict(config.as_dict()) == config


# -- idle keys leave nothing behind -------------------------------------------------------------
def _flood_distinct_keys(backend: AdmissionBackend, clock: FakeClock | None, name: str, keys: int) -> None:
    """One admitted and started call for each of `keys` distinct fairness keys."""
    for i in range(keys):
        ticket = f"run{i}/1"
        assert backend.try_admit(AdmissionRequest(name, ticket, fairness_key=f"tenant-{i}")).admitted
        assert backend.try_start(name, ticket, f"tenant-{i}") == 0
        backend.release(name, ticket)


IDLE_CONFIG = {
    "key_rate_limit": RateLimit(limit=2, period_ms=200, algorithm="sliding"),
    "throttle": Throttle(limit=5, period_ms=200, burst=2, per="key"),
}
#: The same limits over 5 s, for a test on Redis' real clock that counts keys before they expire.
SLOW_IDLE_CONFIG = {
    "key_rate_limit": RateLimit(limit=2, period_ms=5_000, algorithm="sliding"),
    "throttle": Throttle(limit=5, period_ms=5_000, burst=2, per="key"),
}


def test_local_forgets_idle_keys() -> None:
    clock = FakeClock(start_ms=1_800_000_000_000)
    backend = LocalAdmissionBackend(clock=clock)
    backend.register(QueueConfig(name="q", **IDLE_CONFIG))
    _flood_distinct_keys(backend, clock, "q", 500)
    assert backend.keyed_size("q") >= 500
    clock.advance(1_000)
    assert backend.try_admit(AdmissionRequest("q", "late/1", fairness_key="late")).admitted
    assert backend.keyed_size("q") == 2  # the late key's window and throttle bucket


@pytest.mark.django_db(transaction=True)
def test_db_deletes_the_rows_of_idle_keys() -> None:
    clock = FakeClock(start_ms=1_800_000_000_000)
    backend = DatabaseAdmissionBackend(clock=clock)
    backend.register(QueueConfig(name="q", **IDLE_CONFIG))
    _flood_distinct_keys(backend, clock, "q", 200)
    assert rows("q") >= 4 * 200  # grant and start marks, grant and start TATs
    clock.advance(1_000)
    assert backend.try_admit(AdmissionRequest("q", "late/1", fairness_key="late")).admitted
    assert rows("q") == 2  # the late key's grant mark and grant TAT
    assert backend.try_start("q", "late/1", "late") == 0
    clock.advance(1_000)
    backend.grant("q")
    assert rows("q") == 0


def test_redis_lets_the_keys_of_idle_keys_expire() -> None:
    """On Redis' own clock: every per-key key carries a TTL of its window (or TAT) plus 1 s."""
    import redis

    from durable_flow.admission.redis.backend import RedisAdmissionBackend

    prefix = f"test:keyed:{uuid.uuid4().hex[:10]}"
    backend = RedisAdmissionBackend(url=REDIS_URL, key_prefix=prefix)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        backend.register(QueueConfig(name="q", **SLOW_IDLE_CONFIG))
        _flood_distinct_keys(backend, None, "q", 300)
        # The keys live 5 s (plus 1 s): the flood's 900 calls end well before the first expire,
        # even on a busy host, so each of the 300 keys still has its keys here.
        assert backend.keyed_keys("q") > 300
        ttls = [client.pttl(k) for k in client.scan_iter(f"{prefix}:q:q:k*", count=1000)]
        # Every one expires (-2: already gone): within the window, or the throttle's TAT (at most
        # one emission interval, 1 s, past it), plus 1 s.
        assert -1 not in ttls and max(ttls) <= 5_000 + 1_000 + 1_000 + 10
        deadline = time.monotonic() + 60  # expiry needs ~7 s; the margin is for a busy host
        while backend.keyed_keys("q") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert backend.keyed_keys("q") == 0
    finally:
        backend.close()
        delete_keys(client, f"{prefix}:*")
        client.close()


# -- dashboard -----------------------------------------------------------------------------------
def test_the_queue_page_shows_the_busiest_keys_window_use(engine: Any, transactional_db: None) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.urls import reverse

    from durable_flow import start
    from durable_flow.operations import api

    api.register_queue("per-tenant", rate_limit={"limit": 5, "period_ms": 60_000, "per": "key"})
    for i, key in enumerate(["tenant-a"] * 3 + ["tenant-b"]):
        start("tests.queued", {"queue": "per-tenant", "value": i, "key": key})
    client = Client()
    client.force_login(get_user_model().objects.create_user("staff", password="pw", is_staff=True))
    page = client.get(reverse("dashboard:queue", args=["per-tenant"])).content.decode()
    table = page[page.index('id="queue-key-windows"') :]
    assert table.index("tenant-a") < table.index("tenant-b")  # busiest first
    assert "3 / 5" in table and "1 / 5" in table and "60%" in table


@pytest.mark.parametrize(
    ("new", "expected"),
    [
        ({"limit": 50, "period_ms": 1000}, (RateLimit(50, 1000), RateLimit(10, 1000, "sliding"))),
        ({"limit": 3, "period_ms": 500, "per": "key"}, (RateLimit(100, 1000), RateLimit(3, 500))),
        ([{"limit": 3, "period_ms": 500, "per": "key"}], (None, RateLimit(3, 500))),
        (None, (None, None)),
    ],
)
def test_resizing_a_window_keeps_the_other_kind(engine: Any, new: Any, expected: tuple[Any, Any]) -> None:
    """One window replaces only its own kind (the dashboard's resize form sends the global one);
    a list replaces both, None removes both; the throttle is kept."""
    from durable_flow.operations import api

    api.register_queue(
        "both",
        rate_limit=[{"limit": 100, "period_ms": 1000}, PER_KEY],
        throttle={"limit": 5, "period_ms": 1000, "burst": 2},
    )
    config = api.update_queue("both", rate_limit=new)
    assert (config.rate_limit, config.key_rate_limit) == expected
    assert config.throttle == Throttle(5, 1000, burst=2)


# -- the throttle's standing ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ahead_ms", "standing"),
    [(-500, (3, 0)), (0, (3, 0)), (999, (2, 0)), (1000, (2, 0)), (2000, (1, 0)), (2001, (0, 1)), (3000, (0, 1000))],
)
def test_a_buckets_standing_is_its_burst_left_and_its_next_start(ahead_ms: float, standing: tuple[int, int]) -> None:
    """10 per 10 s, bursts of 3: one start a second once the burst of 3 is spent."""
    assert throttle_standing(Throttle(10, 10_000, burst=3), ahead_ms) == standing


def _throttle_usage_after_starts(backend: AdmissionBackend) -> tuple[Any, Any]:
    backend.register(QueueConfig(name="paced", throttle=Throttle(10, 10_000, burst=3, per="key")))
    backend.register(QueueConfig(name="plain", concurrency=5))
    for i, key in enumerate(["tenant-a"] * 3 + ["tenant-b"]):
        assert backend.try_admit(AdmissionRequest("paced", f"run{i}/1", fairness_key=key)).admitted
        assert backend.try_start("paced", f"run{i}/1", key) == 0
    return backend.throttle_usage("paced", 10), backend.throttle_usage("plain", 10)


def test_throttle_usage_ranks_buckets_by_how_far_their_starts_run_ahead_on_every_backend(
    transactional_db: None,
) -> None:
    from durable_flow.admission.redis.backend import RedisAdmissionBackend

    clock = FakeClock(start_ms=1_800_000_000_000)
    redis_backend = RedisAdmissionBackend(url=REDIS_URL, key_prefix=f"test:tu:{uuid.uuid4().hex[:10]}", clock=clock)
    try:
        for backend in (LocalAdmissionBackend(clock=clock), DatabaseAdmissionBackend(clock=clock), redis_backend):
            usage, none = _throttle_usage_after_starts(backend)
            assert usage == [("tenant-a", 3000.0), ("tenant-b", 1000.0)], type(backend).__name__
            assert none is None
            clock.advance(5_000)  # every TAT is past: the buckets are idle
            assert backend.throttle_usage("paced", 10) == [], type(backend).__name__
    finally:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        redis_backend.close()
        delete_keys(client, f"{redis_backend.prefix}:*")
        client.close()


def test_the_queue_page_shows_each_keys_throttle_standing(engine: Any, transactional_db: None) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.urls import reverse

    from durable_flow import start
    from durable_flow.operations import api

    api.register_queue("paced", throttle={"limit": 2, "period_ms": 60_000, "burst": 3, "per": "key"})
    for i, key in enumerate(["tenant-a"] * 3 + ["tenant-b"]):
        start("tests.queued", {"queue": "paced", "value": i, "key": key})
    client = Client()
    client.force_login(get_user_model().objects.create_user("staff", password="pw", is_staff=True))
    page = client.get(reverse("dashboard:queue", args=["paced"])).content.decode()
    table = page[page.index('id="queue-throttle"') : page.index("</table>", page.index('id="queue-throttle"'))]
    assert table.index("tenant-a") < table.index("tenant-b")  # furthest ahead first
    rows = re.findall(r'<th scope="row">([\w-]+)</th><td class="num">[\d.]+ s</td><td class="num">(\d) / 3</td>', table)
    assert rows == [("tenant-a", "0"), ("tenant-b", "2")]  # a spent its burst; b has two starts left
