"""The `rq` transport's lanes from settings alone: which `RQ_QUEUES` entry a flow-control queue's
steps go on (`ROUTES`), and what `manage.py check` says about a route it cannot keep. Nothing
here connects to Redis."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from durable_flow.checks import check_settings
from durable_flow.transports.rq import RQTransport
from durable_flow.transports.rq.common import HIGH, LOW, NORMAL

NEAR = "redis://127.0.0.1:6379/8"
FAR = "redis://127.0.0.1:6390/1"
RQ_QUEUES = {"durable": {"URL": NEAR}, "durable-far": {"URL": FAR}, "default": {"URL": NEAR}}


def findings(transport: dict[str, Any], rq_queues: dict[str, Any] = RQ_QUEUES, queues: Any = ()) -> set[str]:
    """`(id, message)` of what the checks report on this TRANSPORT."""
    setting = {"TRANSPORT": {"BACKEND": "rq", **transport}, "QUEUES": [{"name": name} for name in queues]}
    with override_settings(RQ_QUEUES=rq_queues, DURABLE_FLOW=setting):
        return {f"{message.id}: {message.msg}" for message in check_settings()}


def test_a_routed_queues_steps_go_on_its_lane_and_everything_else_on_queues() -> None:
    with override_settings(RQ_QUEUES=RQ_QUEUES):
        transport = RQTransport(queue="durable", routes={"far": "durable-far"})
        assert list(transport.lanes) == ["durable", "durable-far"]
        assert transport.lane_for("far").name == "durable-far"
        assert transport.lane_for("render").name == transport.lane_for("").name == "durable"
        far = transport.lanes["durable-far"]
        assert [far.tiers[tier].name for tier in (HIGH, NORMAL, LOW)] == [
            "durable-far:high",
            "durable-far",
            "durable-far:low",
        ]
        assert far.claims.key == "rq:durable_flow:durable-far:claimed"
        assert far.server != transport.lanes["durable"].server, "two Redis servers"
        assert far.connection.connection_pool.connection_kwargs["port"] == 6390
        # A worker serves every lane, or those it is given; its RQ queue names cover them all.
        assert transport.source().queues == [
            "durable:high",
            "durable",
            "durable:low",
            "durable-far:high",
            "durable-far",
            "durable-far:low",
        ]
        assert [lane.name for lane in transport.source(lanes=["durable-far"]).lanes] == ["durable-far"]
        with pytest.raises(ImproperlyConfigured, match="no lane 'nope'"):
            transport.source(lanes=["nope"])


def test_two_lanes_on_one_redis_are_served_by_one_wait() -> None:
    with override_settings(RQ_QUEUES=RQ_QUEUES):
        source = RQTransport(queue="durable", routes={"other": "default"}).source()
    assert len(source.servers) == 1 and not source.several
    assert [lane.name for lane in source.servers[0].lanes] == ["durable", "default"]


def test_a_route_to_a_missing_entry_is_e040() -> None:
    found = findings({"ROUTES": {"far": "durable-gone"}}, queues=["far"])
    assert len(found) == 1
    (message,) = found
    assert message.startswith("durable_flow.E040: ")
    assert "[\"ROUTES\"]['far']: 'durable-gone' is not in settings.RQ_QUEUES" in message
    with override_settings(RQ_QUEUES=RQ_QUEUES), pytest.raises(ImproperlyConfigured, match="durable-gone"):
        RQTransport(routes={"far": "durable-gone"})  # and the engine would not build


def test_a_route_for_an_undeclared_queue_is_w041() -> None:
    assert findings({"ROUTES": {"far": "durable-far"}}, queues=["far"]) == set()
    (message,) = findings({"ROUTES": {"fra": "durable-far"}}, queues=["far"])
    assert message.startswith("durable_flow.W041: ") and "'fra'" in message


def test_a_lane_named_like_another_lanes_tier_is_e042() -> None:
    rq_queues = {**RQ_QUEUES, "durable:high": {"URL": NEAR}}
    (message,) = findings({"ROUTES": {"far": "durable:high"}}, rq_queues, queues=["far"])
    assert message.startswith("durable_flow.E042: ") and "'durable:high' is a lane and also the high tier" in message


def test_a_tier_on_another_redis_than_its_lane_is_e043() -> None:
    rq_queues = {**RQ_QUEUES, "durable-far:low": {"URL": NEAR}}
    (message,) = findings({"ROUTES": {"far": "durable-far"}}, rq_queues, queues=["far"])
    assert message.startswith("durable_flow.E043: ") and "['durable-far:low'] is on another Redis" in message
    same = {**RQ_QUEUES, "durable-far:low": {"URL": FAR}}
    assert findings({"ROUTES": {"far": "durable-far"}}, same, queues=["far"]) == set()


@pytest.mark.parametrize(
    ("routes", "problem"),
    [
        (["far"], "must be a dict of queue names to RQ_QUEUES entries, got list"),
        ({"far": ""}, "['far']: must be a"),
        ({"": "durable-far"}, "a queue name must be a"),
    ],
)
def test_a_malformed_routes_is_e005(routes: Any, problem: str) -> None:
    (message,) = findings({"ROUTES": routes})
    assert message.startswith("durable_flow.E005: ") and problem in message, message
