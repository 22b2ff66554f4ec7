"""Every name, id and key is bounded by the column that stores it: one as long as the column
takes is accepted, one character longer is refused with a typed error (never a DataError)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db.models import Model

from durable_flow.definitions.quotas import check_key
from durable_flow.definitions.registry import step, workflow
from durable_flow.exceptions import InvalidInput, InvalidQueueConfig, InvalidQuota, RegistrationError
from durable_flow.models import FlowQueue, Signal, StepCheckpoint, WorkflowRun
from durable_flow.operations import api


def column(model: type[Model], field: str) -> int:
    length = model._meta.get_field(field).max_length
    assert length is not None
    return length


def test_a_run_id_as_long_as_its_column_starts_and_one_longer_is_refused(engine: Any) -> None:
    longest = column(WorkflowRun, "id")
    assert api.start("tests.sleeper", 60, run_id="r" * longest).pk == "r" * longest
    with pytest.raises(InvalidInput, match=f"at most {longest} characters"):
        api.start("tests.sleeper", 60, run_id="r" * (longest + 1))


def test_a_signal_name_as_long_as_its_column_is_sent_and_one_longer_is_refused(engine: Any) -> None:
    run = api.start("tests.sleeper", 60)
    longest = column(Signal, "name")
    api.send_signal(run.pk, "s" * longest)
    with pytest.raises(InvalidInput, match=f"at most {longest} characters"):
        api.send_signal(run.pk, "s" * (longest + 1))


def test_a_queue_name_as_long_as_its_column_registers_and_one_longer_is_refused(engine: Any) -> None:
    longest = column(FlowQueue, "name")
    assert api.register_queue("q" * longest, concurrency=1).name == "q" * longest
    with pytest.raises(InvalidQueueConfig, match=f"at most {longest} characters"):
        api.register_queue("q" * (longest + 1), concurrency=1)


def test_a_quota_key_as_long_as_its_column_is_taken_and_one_longer_is_refused() -> None:
    longest = column(WorkflowRun, "concurrency_key")
    assert check_key("k" * longest) == "k" * longest
    with pytest.raises(InvalidQuota, match=f"at most {longest} characters"):
        check_key("k" * (longest + 1))


@pytest.mark.parametrize(
    ("declare", "model", "field"), [(workflow, WorkflowRun, "workflow"), (step, StepCheckpoint, "name")]
)
def test_a_registered_name_longer_than_its_column_is_refused(declare: Any, model: type[Model], field: str) -> None:
    longest = column(model, field)
    with pytest.raises(RegistrationError, match=f"at most {longest} characters"):
        declare("n" * (longest + 1))(lambda ctx, value: value)
