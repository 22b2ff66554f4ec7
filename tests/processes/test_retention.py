"""Retention: finished runs deleted past their age, in batches, never orphaning a row (a purge
process killed halfway included)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from durable_flow import cancel, start
from durable_flow.config.settings import reset_settings
from durable_flow.definitions.registry import workflow
from durable_flow.exceptions import RegistrationError
from durable_flow.models import (
    AttemptStatus,
    Event,
    EventAction,
    EventDelivery,
    RunStatus,
    Signal,
    StepAttempt,
    StepCheckpoint,
    StepStatus,
    Task,
    WorkflowRun,
)
from durable_flow.runtime.poller import TimerPoller
from durable_flow.store import metric_counts, retention
from durable_flow.store.retention import RetentionPolicy, Scope, purge
from tests.conftest import ManagedProcess, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

DAY = timedelta(days=1)


def make_runs(
    prefix: str,
    count: int,
    *,
    finished: datetime | None,
    workflow_name: str = "tests.three_steps",
    status: str = RunStatus.COMPLETED,
    parent: str | None = None,
) -> list[str]:
    """`count` runs as the engine leaves them (a checkpoint, its attempt, a consumed signal),
    finished at `finished` (None: still running), created a minute before."""
    ids = [f"{prefix}-{i:05d}" for i in range(count)]
    created = (finished or timezone.now()) - timedelta(minutes=1)
    runs = WorkflowRun.objects.bulk_create(
        WorkflowRun(
            id=run_id,
            workflow=workflow_name,
            status=status if finished else RunStatus.SUSPENDED,
            finished_at=finished,
            parent_id=parent,
        )
        for run_id in ids
    )
    # `auto_now_add` stamps now: put each run back to when it was made.
    WorkflowRun.objects.filter(id__in=ids).update(created_at=created, updated_at=finished or created)
    checkpoints = StepCheckpoint.objects.bulk_create(
        StepCheckpoint(run=run, key="1", sequence=1, name="tests.add_one", status=StepStatus.COMPLETED) for run in runs
    )
    StepAttempt.objects.bulk_create(
        StepAttempt(checkpoint=cp, run_id=cp.run_id, attempt=1, status=AttemptStatus.COMPLETED) for cp in checkpoints
    )
    Signal.objects.bulk_create(Signal(run=run, name="approve", consumed_by="2") for run in runs)
    return ids


def orphans() -> dict[str, int]:
    """Rows naming a run (or a checkpoint, or a parent) that is not there, by table: SQL over
    the tables themselves, so nothing the ORM caches hides one."""
    q = connection.ops.quote_name
    run = q(WorkflowRun._meta.db_table)
    checks = {
        "checkpoints": (StepCheckpoint, "run_id", run),
        "attempts": (StepAttempt, "run_id", run),
        "attempt checkpoints": (StepAttempt, "checkpoint_id", q(StepCheckpoint._meta.db_table)),
        "signals": (Signal, "run_id", run),
        "tasks": (Task, "run_id", run),
        "parents": (WorkflowRun, "parent_id", run),
    }
    found = {}
    with connection.cursor() as cursor:
        for name, (model, column, target) in checks.items():
            table = q(model._meta.db_table)
            cursor.execute(
                f"SELECT COUNT(*) FROM {table} child WHERE child.{q(column)} IS NOT NULL AND NOT EXISTS "
                f"(SELECT 1 FROM {target} t WHERE t.{q('id')} = child.{q(column)})"
            )
            found[name] = cursor.fetchone()[0]
    return found


NO_ORPHANS = {"checkpoints": 0, "attempts": 0, "attempt checkpoints": 0, "signals": 0, "tasks": 0, "parents": 0}


def rows_of(run_ids: list[str]) -> dict[str, int]:
    return {
        "runs": WorkflowRun.objects.filter(id__in=run_ids).count(),
        "checkpoints": StepCheckpoint.objects.filter(run_id__in=run_ids).count(),
        "attempts": StepAttempt.objects.filter(run_id__in=run_ids).count(),
        "signals": Signal.objects.filter(run_id__in=run_ids).count(),
    }


GONE = {"runs": 0, "checkpoints": 0, "attempts": 0, "signals": 0}


# -- what goes and what stays ----------------------------------------------------------------
def test_a_finished_run_past_its_retention_goes_with_every_row_of_its_own(engine: Any, clock: Any) -> None:
    finished = start("tests.three_steps", 1)
    waiting = start("tests.signal_waiter", None)
    cancelled = start("tests.signal_waiter", None)
    cancel(cancelled.id)
    assert WorkflowRun.objects.get(pk=finished.id).status == RunStatus.COMPLETED
    assert StepAttempt.objects.filter(run_id=finished.id).count() == 3

    done = purge([Scope(timezone.now() + DAY)], batch_size=10)

    assert rows_of([finished.id, cancelled.id]) == GONE
    assert WorkflowRun.objects.get(pk=waiting.id).status == RunStatus.SUSPENDED  # unfinished: kept
    assert done.runs == 2 and done.rows["checkpoints"] == 4 and done.rows["attempts"] == 3
    assert orphans() == NO_ORPHANS


def test_a_run_finished_inside_its_retention_stays() -> None:
    now = timezone.now()
    old = make_runs("old", 3, finished=now - 3 * DAY)
    young = make_runs("young", 3, finished=now - DAY / 2)
    purge(RetentionPolicy(DAY).scopes(now), batch_size=100)
    assert rows_of(old) == GONE
    assert rows_of(young) == {"runs": 3, "checkpoints": 3, "attempts": 3, "signals": 3}


@pytest.mark.parametrize("status", [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED])
def test_every_terminal_status_is_finished(status: str) -> None:
    ids = make_runs("end", 2, finished=timezone.now() - 3 * DAY, status=status)
    purge([Scope(timezone.now() - DAY)], batch_size=10)
    assert rows_of(ids) == GONE


def test_an_old_run_that_is_not_finished_stays() -> None:
    # Created long ago and still suspended (a long sleep): no finish, so no age to count.
    ids = make_runs("parked", 2, finished=None)
    WorkflowRun.objects.filter(id__in=ids).update(created_at=timezone.now() - 30 * DAY)
    purge([Scope(timezone.now())], batch_size=10)
    assert rows_of(ids)["runs"] == 2


def test_a_finished_child_of_an_unfinished_parent_stays_until_the_parent_finishes() -> None:
    now = timezone.now()
    [parent] = make_runs("parent", 1, finished=None)
    children = make_runs("child", 2, finished=now - 3 * DAY, parent=parent)
    purge([Scope(now - DAY)], batch_size=10)
    assert rows_of(children)["runs"] == 2

    WorkflowRun.objects.filter(pk=parent).update(
        status=RunStatus.COMPLETED, created_at=now - 4 * DAY, finished_at=now - 2 * DAY
    )
    purge([Scope(now - DAY)], batch_size=10)
    assert rows_of([parent, *children]) == GONE
    assert orphans() == NO_ORPHANS


def test_a_finished_parent_of_an_unfinished_child_stays() -> None:
    now = timezone.now()
    [parent] = make_runs("parent", 1, finished=now - 3 * DAY, status=RunStatus.CANCELLED)
    [child] = make_runs("child", 1, finished=None, parent=parent)
    purge([Scope(now - DAY)], batch_size=10)
    assert rows_of([parent])["runs"] == 1
    assert WorkflowRun.objects.get(pk=child).parent_id == parent


def test_a_finished_child_kept_longer_than_its_parent_loses_only_its_link() -> None:
    now = timezone.now()
    [parent] = make_runs("parent", 1, finished=now - 3 * DAY, workflow_name="tests.child_parent")
    [child] = make_runs("child", 1, finished=now - 3 * DAY, parent=parent)
    policy = RetentionPolicy(DAY, {"tests.three_steps": 10 * DAY})
    purge(policy.scopes(now), batch_size=10)
    assert rows_of([parent]) == GONE
    kept = WorkflowRun.objects.get(pk=child)
    assert kept.parent_id is None and rows_of([child])["checkpoints"] == 1
    assert orphans() == NO_ORPHANS


def test_a_workflow_retention_overrides_the_default_both_ways() -> None:
    now = timezone.now()
    short = make_runs("short", 2, finished=now - 2 * DAY, workflow_name="tests.echo_flow")
    long = make_runs("long", 2, finished=now - 2 * DAY, workflow_name="tests.three_steps")
    other = make_runs("other", 2, finished=now - 2 * DAY, workflow_name="tests.fails")
    policy = RetentionPolicy(5 * DAY, {"tests.echo_flow": DAY, "tests.three_steps": 30 * DAY})
    purge(policy.scopes(now), batch_size=10)
    assert rows_of(short) == GONE
    assert rows_of(long)["runs"] == 2 and rows_of(other)["runs"] == 2


def test_an_event_goes_with_the_last_run_it_touched_and_one_that_touched_none_with_age(settings: Any) -> None:
    now = timezone.now()
    old = make_runs("old", 2, finished=now - 3 * DAY)
    young = make_runs("young", 1, finished=now)
    received = {"received_at": now - 4 * DAY, "pending": False}
    both = Event.objects.create(id="both", name="tests/orders.created", data={}, **received)
    only_old = Event.objects.create(id="only-old", name="tests/orders.created", data={}, **received)
    Event.objects.create(id="untouched", name="tests/orders.paid", data={}, **received)
    Event.objects.create(id="recent", name="tests/orders.paid", data={}, received_at=now, pending=False)
    EventDelivery.objects.bulk_create(
        [
            EventDelivery(event=only_old, action=EventAction.STARTED, workflow="tests.three_steps", run_id=old[0]),
            EventDelivery(event=both, action=EventAction.STARTED, workflow="tests.three_steps", run_id=old[1]),
            EventDelivery(event=both, action=EventAction.RESUMED, workflow="tests.three_steps", run_id=young[0]),
        ]
    )
    done = retention.purge_pass(reset_and_get(settings, {"RUN_RETENTION_S": 2 * 86400}), now)
    assert done.runs == 2 and done.rows["event_deliveries"] == 2 and done.rows["events"] == 2
    # `both` still names the young run; `recent` is younger than the retention.
    assert set(Event.objects.values_list("id", flat=True)) == {"both", "recent"}
    assert list(EventDelivery.objects.values_list("run_id", flat=True)) == [young[0]]


def test_no_retention_configured_purges_nothing(settings: Any) -> None:
    ids = make_runs("kept", 2, finished=timezone.now() - 3000 * DAY)
    assert retention.purge_pass(reset_and_get(settings, {}), timezone.now()).runs == 0
    assert rows_of(ids)["runs"] == 2


def reset_and_get(settings: Any, poller: dict[str, Any]) -> Any:
    from durable_flow.config.settings import get_settings

    settings.DURABLE_FLOW = {**settings.DURABLE_FLOW, "POLLER": poller}
    reset_settings()
    return get_settings()


# -- batches ---------------------------------------------------------------------------------
def test_the_poller_purges_a_bounded_number_of_batches_per_pass(settings: Any, manual: Any) -> None:
    ids = make_runs("old", 25, finished=timezone.now() - 3 * DAY)
    config = reset_and_get(settings, {"RUN_RETENTION_S": 86_400, "PURGE_BATCH_SIZE": 4, "PURGE_BATCHES": 3})
    manual.settings = config
    poller = TimerPoller(engine=manual)
    poller.maintain()
    assert rows_of(ids)["runs"] == 25 - 12
    poller.maintain()
    poller.maintain()
    assert rows_of(ids) == GONE
    reset_settings()


def test_a_pass_starts_no_batch_once_its_time_is_spent(settings: Any) -> None:
    """`PURGE_PASS_S` bounds the time a pass purges, whatever `PURGE_BATCHES` allows: on a busy
    database, whose batches are slow, the purge slows down instead of taking more of it."""
    ids = make_runs("old", 25, finished=timezone.now() - 3 * DAY)
    ticks = iter(range(100))  # a clock whose every reading is a second later: each batch "takes" 1 s

    done = purge([Scope(timezone.now() - DAY)], batch_size=4, max_seconds=2.5, clock=lambda: float(next(ticks)))
    assert (done.batches, rows_of(ids)["runs"]) == (3, 25 - 12)  # started at 0, 1 and 2 s; none at 3 s

    config = reset_and_get(settings, {"RUN_RETENTION_S": 86_400, "PURGE_BATCH_SIZE": 4, "PURGE_PASS_S": 0.001})
    assert config.purge_pass_s == 0.001
    retention.purge_pass(config, timezone.now())
    assert rows_of(ids)["runs"] == 25 - 12 - 4  # one batch at least, then the time is spent
    reset_settings()


def test_a_purge_failing_between_batches_leaves_no_orphans_and_resumes() -> None:
    ids = make_runs("old", 30, finished=timezone.now() - 3 * DAY)
    batches: list[int] = []

    def fail_after_two(done: retention.Purged) -> None:
        batches.append(done.runs)
        if len(batches) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        purge([Scope(timezone.now() - DAY)], batch_size=7, after_batch=fail_after_two)
    assert rows_of(ids)["runs"] == 30 - 14
    assert orphans() == NO_ORPHANS

    purge([Scope(timezone.now() - DAY)], batch_size=7)
    assert rows_of(ids) == GONE
    assert orphans() == NO_ORPHANS


# -- the command -----------------------------------------------------------------------------
def command(*args: str) -> str:
    out = StringIO()
    call_command("durable_purge", *args, stdout=out)
    return out.getvalue()


def test_a_dry_run_counts_each_table_and_deletes_nothing() -> None:
    ids = make_runs("old", 4, finished=timezone.now() - 3 * DAY)
    make_runs("young", 2, finished=timezone.now())
    out = command("--older-than", "2d", "--dry-run")
    assert "runs: 4\n" in out and "checkpoints: 4\n" in out and "attempts: 4\n" in out and "signals: 4\n" in out
    assert rows_of(ids)["runs"] == 4


def test_the_command_purges_one_workflow_older_than_the_age_given() -> None:
    now = timezone.now()
    echo = make_runs("echo", 3, finished=now - 3 * DAY, workflow_name="tests.echo_flow")
    other = make_runs("other", 3, finished=now - 3 * DAY)
    out = command("--older-than", "48h", "--workflow", "tests.echo_flow", "--batch-size", "2")
    assert "deleted 3 finished run(s) in 2 batch(es)" in out
    assert rows_of(echo) == GONE and rows_of(other)["runs"] == 3


@pytest.mark.parametrize("age", ["0", "-3d", "3 days", "nan", "inf", "99999w"])
def test_the_command_refuses_an_age_that_is_not_one(age: str) -> None:
    with pytest.raises(CommandError, match="--older-than must be"):
        command(f"--older-than={age}")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-size=0"], "--batch-size must be"),
        (["--batch-size=10001"], "--batch-size must be"),
        (["--pause-ms=-1"], "--pause-ms must be"),
        (["--workflow=a\x00b"], "--workflow contains a NUL"),
        ([f"--workflow={'w' * 201}"], "--workflow must be at most"),
    ],
)
def test_the_command_refuses_bad_flags_by_name(flags: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        command("--older-than=1d", *flags)


def test_the_command_without_an_age_applies_the_configured_retention() -> None:
    now = timezone.now()
    old = make_runs("old", 2, finished=now - 8 * DAY, workflow_name="tests.retention.kept_a_week")
    young = make_runs("young", 2, finished=now - 6 * DAY, workflow_name="tests.retention.kept_a_week")
    other = make_runs("other", 2, finished=now - 3000 * DAY)  # no retention of its own, and no default
    assert "deleted 2 finished run(s)" in command()
    assert rows_of(old) == GONE and rows_of(young)["runs"] == 2 and rows_of(other)["runs"] == 2


def test_the_command_needs_an_age_for_a_workflow_with_no_retention_configured() -> None:
    with pytest.raises(CommandError, match=r"'tests\.echo_flow' has no retention configured"):
        command("--dry-run", "--workflow", "tests.echo_flow")


def test_a_purge_process_killed_halfway_resumes_and_leaves_no_orphans(spawn: Callable[..., ManagedProcess]) -> None:
    ids = make_runs("old", 600, finished=timezone.now() - 3 * DAY)
    purging = spawn("durable_purge", "--older-than", "1d", "--batch-size", "10", "--pause-ms", "50")
    wait_for(lambda: purging.output().count("batch:") >= 3, timeout=120, what="a few batches")
    purging.proc.send_signal(signal.SIGKILL)
    purging.proc.wait(30)
    left = rows_of(ids)["runs"]
    assert 0 < left < 600, purging.output()
    assert orphans() == NO_ORPHANS

    out = command("--older-than", "1d", "--batch-size", "100")
    assert f"deleted {left} finished run(s)" in out
    assert rows_of(ids) == GONE and orphans() == NO_ORPHANS


# -- what it tells -----------------------------------------------------------------------------
def test_what_retention_removed_is_counted_by_workflow_and_table() -> None:
    make_runs("old", 3, finished=timezone.now() - 3 * DAY, workflow_name="tests.echo_flow")
    purge([Scope(timezone.now() - DAY)], batch_size=2)
    metric_counts.flush()
    totals = metric_counts.totals()
    assert totals[retention.RUNS_PURGED] == {(("workflow", "tests.echo_flow"),): 3}
    assert totals[retention.ROWS_PURGED][(("table", "checkpoints"),)] == 3
    assert totals[retention.ROWS_PURGED][(("table", "runs"),)] == 3


# -- declaring it ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [timedelta(minutes=59), timedelta(days=3651), 86_400, "7d", timedelta(0)])
def test_a_workflow_retention_outside_its_bounds_is_refused_at_declaration(bad: object) -> None:
    with pytest.raises(RegistrationError, match="retention must be None or a timedelta from 1 hour"):
        workflow("tests.bad_retention", retention=bad)  # type: ignore[arg-type]


@workflow("tests.retention.kept_a_week", retention=timedelta(days=7))
def kept_a_week(ctx: Any, input: Any) -> None:
    return None


def test_a_declared_retention_is_in_the_configured_policy(settings: Any) -> None:
    policy = RetentionPolicy.configured(reset_and_get(settings, {"RUN_RETENTION_S": 3600}))
    assert policy.default == timedelta(hours=1)
    assert policy.by_workflow["tests.retention.kept_a_week"] == timedelta(days=7)
    reset_settings()


def test_the_metrics_endpoint_shows_what_retention_removed(staff_client: Any) -> None:
    make_runs("old", 2, finished=timezone.now() - 3 * DAY, workflow_name="tests.echo_flow")
    command("--older-than", "1d")
    text = staff_client.get("/metrics/").content.decode()
    assert 'durable_flow_runs_purged_total{workflow="tests.echo_flow"} 2.0' in text
    assert 'durable_flow_rows_purged_total{table="checkpoints"} 2.0' in text


def test_the_overview_says_how_long_runs_are_kept_and_what_retention_removed(
    staff_client: Any, settings: Any, manual: Any
) -> None:
    manual.settings = reset_and_get(settings, {"RUN_RETENTION_S": 30 * 86_400})
    before = staff_client.get(reverse("dashboard:index")).content.decode()
    assert "Finished runs are kept 30 days; <code>tests.retention.kept_a_week</code>'s 7 days." in before
    assert "Retention has removed nothing yet." in before

    make_runs("old", 3, finished=timezone.now() - 40 * DAY)
    TimerPoller(engine=manual).maintain()
    after = staff_client.get(reverse("dashboard:index")).content.decode()
    assert (
        'Retention removed <span class="runs">3</span> finished run(s) with 3 attempts, 3 checkpoints, 3 signals;'
        in after
    )
    reset_settings()
