"""Event declarations: a `trigger=`, `trigger_if=` or `cancel_on=` that does not parse is refused
at `@workflow` with its check id and a hint; a trigger or a `cancel_on` naming an event
`DURABLE_FLOW["EVENTS"]` does not declare, and a malformed `EVENTS`, fail `manage.py check`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from durable_flow.checks import check_settings
from durable_flow.config.limits import RUN_ID_LENGTH
from durable_flow.config.settings import reset_settings
from durable_flow.definitions import registry
from durable_flow.definitions.events import EventDeclarationError, compile_condition, triggered_run_id
from durable_flow.definitions.registry import workflow
from durable_flow.exceptions import RegistrationError


def _noop(ctx: Any, event: Any) -> None:
    return None


@pytest.mark.parametrize(
    ("options", "check_id", "says"),
    [
        ({"trigger": "tests/orders.created", "trigger_if": "event.data.total >"}, "E022", "not a valid CEL expression"),
        (
            {"trigger": "tests/orders.created", "cancel_on": [{"event": "tests/orders.cancelled", "match": "a ==="}]},
            "E022",
            "cancel_on[0] match: 'a ===' is not a valid CEL expression",
        ),
        ({"trigger": "orders created"}, "E024", "trigger must start with a letter or digit"),
        ({"trigger": ""}, "E024", "trigger must be a non-empty string"),
        ({"trigger": []}, "E024", "trigger must be an event name or a list"),
        ({"trigger": ["tests/fanout", "tests/fanout"]}, "E024", "names an event twice"),
        ({"trigger_if": "event.data.total > 1"}, "E024", "trigger_if needs a trigger"),
        ({"trigger": "tests/fanout", "trigger_if": 3}, "E024", "trigger_if must be a CEL expression"),
        ({"cancel_on": [{"event": "tests/fanout", "when": "x"}]}, "E024", "unknown field(s) when"),
        ({"cancel_on": 7}, "E024", "cancel_on must be a list"),
        ({"cancel_on": [{"match": "true"}]}, "E024", "cancel_on[0] event must be a non-empty string"),
        ({"trigger": "tests/fanout", "internal": True}, "E024", "a built-in workflow cannot declare events"),
    ],
)
def test_a_bad_event_declaration_is_refused_at_declaration_with_its_id_and_a_hint(
    options: dict[str, Any], check_id: str, says: str
) -> None:
    with pytest.raises(EventDeclarationError) as caught:
        workflow("tests.bad-events", **options)(_noop)
    assert isinstance(caught.value, RegistrationError)
    assert caught.value.check_id == check_id
    message = str(caught.value)
    assert "workflow 'tests.bad-events'" in message and says in message
    assert f"[durable_flow.{check_id}]" in message and "hint:" in message
    assert "tests.bad-events" not in registry.workflows()


@pytest.fixture
def declared() -> Iterator[None]:
    workflow(
        "tests.check-events",
        trigger=["tests/orders.created", "tests/orders.misspelt"],
        cancel_on=[{"event": "tests/orders.gone", "match": "async.data.id == event.data.id"}],
    )(_noop)
    yield
    registry._workflows.pop("tests.check-events", None)


def test_check_fails_a_trigger_or_cancel_on_naming_an_undeclared_event(declared: None) -> None:
    errors = [message for message in check_settings() if "tests.check-events" in message.msg]
    assert [(m.id, m.msg) for m in errors] == [
        (
            "durable_flow.E021",
            "workflow 'tests.check-events': trigger 'tests/orders.misspelt' is not declared in "
            'DURABLE_FLOW["EVENTS"]',
        ),
        (
            "durable_flow.E023",
            "workflow 'tests.check-events': cancel_on event 'tests/orders.gone' is not declared in "
            'DURABLE_FLOW["EVENTS"]',
        ),
    ]
    assert all('DURABLE_FLOW["EVENTS"]' in m.hint for m in errors)


@pytest.mark.parametrize(
    ("events", "says"),
    [
        ("tests/orders.created", "must be a list of event names"),
        (["ok", "has space"], 'DURABLE_FLOW["EVENTS"][1]: must start with a letter or digit'),
        (["a", "a"], "event 'a' is declared twice"),
        ([""], "must be a non-empty string"),
    ],
)
def test_check_fails_a_malformed_events_setting(settings: Any, events: Any, says: str) -> None:
    settings.DURABLE_FLOW = {**settings.DURABLE_FLOW, "EVENTS": events}
    reset_settings()
    try:
        errors = check_settings()
    finally:
        reset_settings()
    assert [m.id for m in errors] == ["durable_flow.E020"]
    assert says in errors[0].msg


def test_a_condition_holds_only_when_true_and_a_missing_field_is_no_match() -> None:
    condition = compile_condition("async.data.id == event.data.id")
    assert condition.holds(event={"data": {"id": 1}}, incoming={"data": {"id": 1}})
    assert not condition.holds(event={"data": {"id": 1}}, incoming={"data": {"id": 2}})
    assert not condition.holds(event={"data": {}}, incoming={"data": {"id": 2}})
    assert not compile_condition('"yes"').holds(event={})  # true only, not truthy


def test_a_triggered_run_id_is_deterministic_and_fits_the_column() -> None:
    assert triggered_run_id("fulfil", "o-17") == "fulfil@event:o-17"
    long = triggered_run_id("w" * 150, "e" * 200)
    assert len(long) == RUN_ID_LENGTH and long == triggered_run_id("w" * 150, "e" * 200)
    assert long != triggered_run_id("w" * 150, "e" * 199 + "f")
