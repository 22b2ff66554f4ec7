"""Waits in operator words (`observe/waits.py`): each recorded cause as the pages write it, the
two waits read from the engine's times (no worker free, poller), and dates only off today."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from durable_flow.models import RunStatus, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from durable_flow.observe.run_filters import filtered_runs
from durable_flow.observe.waits import NO_WORKER, POLLER, current_waits, describe, when

NOW = datetime(2026, 12, 7, 10, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("detail", "text"),
    [
        ({"cause": "cap", "queue": "render", "limit": 2}, "queue `render`: cap 2/2"),
        (
            {"cause": "rate", "queue": "api", "limit": 20, "period_ms": 1000, "until": "2026-12-07T10:00:01.250+00:00"},
            "queue `api`: rate window 20/20 per 1 s until 10:00:01.250",
        ),
        (
            {"cause": "key_rate", "queue": "q", "key": "cust-7", "limit": 2, "period_ms": 60_000, "until": None},
            "queue `q`: key `cust-7` limit 2 per 60 s",
        ),
        ({"cause": "key", "queue": "", "key": "cust-7", "scope": "fn", "limit": 1}, "key `cust-7` limit 1"),
        (
            {"cause": "key", "queue": "", "key": "openai", "scope": "account", "limit": 5},
            "key `openai` (account) limit 5",
        ),
        ({"cause": "paused", "queue": "exports"}, "queue `exports`: queue paused"),
        ({"cause": "turn", "queue": "q"}, "queue `q`: others ahead in line"),
        (
            {"cause": "signal", "names": ["approve"], "until": "2026-12-08T01:06:05.541+00:00"},
            "signal `approve`, times out 2026-12-08 01:06:05.541",
        ),
        ({"cause": "sleep", "until": "2026-12-07T11:00:00.000+00:00"}, "sleeping until 11:00:00.000"),
        ({"cause": "cap", "queue": "render"}, "queue `render`: cap full"),  # a backend that does not say the limit
        (None, ""),
    ],
)
def test_each_cause_reads_in_operator_words(detail: dict | None, text: str) -> None:
    assert describe(detail, NOW) == text


def test_a_time_has_its_date_only_when_it_is_not_today() -> None:
    assert when(NOW + timedelta(hours=1), NOW) == "11:00:00.000"
    assert when(NOW + timedelta(days=1), NOW) == "2026-12-08 10:00:00.000"
    assert when(None, NOW) == "—"


@pytest.mark.django_db
def test_a_step_not_yet_claimed_waits_for_a_worker_and_a_due_backoff_for_the_poller() -> None:
    run = WorkflowRun.objects.create(workflow="t", status=RunStatus.SUSPENDED)
    sent = StepCheckpoint.objects.create(
        run=run, key="1", sequence=1, kind=StepKind.STEP, name="s", status=StepStatus.DISPATCHED, attempt=1
    )
    due = StepCheckpoint.objects.create(
        run=run,
        key="2",
        sequence=2,
        kind=StepKind.STEP,
        name="s",
        status=StepStatus.RETRYING,
        wake_at=NOW - timedelta(seconds=2),
        wait_cause="backoff",
        wait_detail={"cause": "backoff", "until": (NOW - timedelta(seconds=2)).isoformat()},
    )
    waits = {w.key: w for w in current_waits(run, [sent, due], NOW)}
    assert (waits["1"].cause, waits["1"].text) == ("worker", NO_WORKER)
    assert waits["2"].text.startswith(POLLER)
    assert set(filtered_runs({"waiting": "worker"}).values_list("pk", flat=True)) == {run.pk}
    StepCheckpoint.objects.filter(pk=sent.pk).update(worker="w-1")  # claimed
    assert not filtered_runs({"waiting": "worker"}).exists()
    assert set(filtered_runs({"waiting": "backoff"}).values_list("pk", flat=True)) == {run.pk}
    WorkflowRun.objects.filter(pk=run.pk).update(status=RunStatus.CANCELLED)
    assert not filtered_runs({"waiting": "backoff"}).exists()  # a finished run waits for nothing
