"""The metric counter store (`durable_flow.store.metric_counts`): counts taken at the commit with
no statement, written in one batch into the process's own rows, summed over processes, folded
into `retired` without a total ever dropping."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, transaction
from django.test import Client
from django.utils import timezone

from durable_flow.models import MetricCount
from durable_flow.store import metric_counts
from durable_flow.store.metric_counts import RETIRED, RUNS_FINISHED, STEP_DURATION
from tests.support.statements import capture

pytestmark = pytest.mark.django_db(transaction=True)

COMPLETED = (("status", "completed"), ("workflow", "w"))


def test_a_count_is_taken_at_the_commit_and_sends_no_statement() -> None:
    with capture() as sent:
        with transaction.atomic():
            metric_counts.count(RUNS_FINISHED, {"workflow": "w", "status": "completed"})
            assert metric_counts.pending() == {}  # not before the commit
        with pytest.raises(RuntimeError), transaction.atomic():
            metric_counts.count(RUNS_FINISHED, {"workflow": "w", "status": "completed"})
            raise RuntimeError("the turn failed")
    assert sent.data == []
    assert metric_counts.pending() == {(RUNS_FINISHED, COMPLETED): 1}  # the rolled-back one is not counted


def test_a_flush_writes_every_series_in_one_statement_into_this_process_rows() -> None:
    metric_counts.set_process("host:w0")
    for workflow in ("a", "b", "c"):
        metric_counts.count(RUNS_FINISHED, {"workflow": workflow, "status": "failed"}, 2)
    metric_counts.observe(STEP_DURATION, {"step": "s"}, 0.3)
    with capture() as sent:
        assert metric_counts.flush() == 6  # three counters, a bucket, a count, a sum
    assert len([sql for sql in sent.data if sql.startswith("INSERT")]) == 1
    assert set(MetricCount.objects.values_list("process", flat=True)) == {"host:w0"}
    assert metric_counts.flush() == 0  # nothing pending: no statement
    metric_counts.count(RUNS_FINISHED, {"workflow": "a", "status": "failed"})
    metric_counts.flush()  # adds to the row it wrote before
    totals = metric_counts.totals()
    assert totals[RUNS_FINISHED][(("status", "failed"), ("workflow", "a"))] == 3
    assert totals[f"{STEP_DURATION}_bucket"] == {(("le", "0.5"), ("step", "s")): 1}
    assert totals[f"{STEP_DURATION}_sum"] == {(("step", "s"),): pytest.approx(0.3)}


def test_processes_write_their_own_rows_and_a_scrape_sums_them(staff_client: Client) -> None:
    for process, amount in (("host:w0", 2), ("host:w1", 3), ("web:12", 4)):
        metric_counts.set_process(process)
        metric_counts.count(RUNS_FINISHED, {"workflow": "w", "status": "completed"}, amount)
        metric_counts.flush()
    assert MetricCount.objects.count() == 3
    metric_counts.set_process(None)
    metric_counts.count(RUNS_FINISHED, {"workflow": "w", "status": "completed"})  # this process: pending
    text = staff_client.get("/metrics/").content.decode()  # the scrape writes it first
    assert 'durable_flow_runs_finished_total{status="completed",workflow="w"} 10.0' in text


def test_retire_folds_silent_processes_and_keeps_every_total() -> None:
    long_ago = timezone.now() - timedelta(days=1)
    for process in ("host:1", "host:2", "host:3"):
        metric_counts.set_process(process)
        metric_counts.count(RUNS_FINISHED, {"workflow": "w", "status": "completed"}, 5)
        metric_counts.observe(STEP_DURATION, {"step": "s"}, 2)
        metric_counts.flush()
    MetricCount.objects.exclude(process="host:3").update(updated_at=long_ago)
    before = metric_counts.totals()
    assert metric_counts.retire() == 8  # two processes' four rows each
    assert metric_counts.totals() == before
    assert set(MetricCount.objects.values_list("process", flat=True)) == {"host:3", RETIRED}
    # Folded again later: added to the retired rows, not replacing them.
    MetricCount.objects.filter(process="host:3").update(updated_at=long_ago)
    assert metric_counts.retire() == 4
    assert metric_counts.totals() == before
    assert set(MetricCount.objects.values_list("process", flat=True)) == {RETIRED}


def test_a_failed_flush_keeps_its_counts_for_the_next_one() -> None:
    metric_counts.count(RUNS_FINISHED, {"workflow": "w", "status": "completed"}, 7)

    def refuse(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        raise DatabaseError("the database is away")

    with connection.execute_wrapper(refuse), pytest.raises(DatabaseError):
        metric_counts.flush()
    assert metric_counts.pending() == {(RUNS_FINISHED, COMPLETED): 7}
    metric_counts.flush()
    assert metric_counts.totals()[RUNS_FINISHED] == {COMPLETED: 7}


def test_an_observation_lands_in_its_bucket_and_one_past_the_last_bound_in_inf() -> None:
    metric_counts.observe(STEP_DURATION, {"step": "s"}, 0.005)  # on a bound: that bucket (le is <=)
    metric_counts.observe(STEP_DURATION, {"step": "s"}, 10_000)
    metric_counts.flush()
    buckets = metric_counts.totals()[f"{STEP_DURATION}_bucket"]
    assert buckets == {(("le", "0.005"), ("step", "s")): 1, (("le", "+Inf"), ("step", "s")): 1}


def test_a_web_process_writes_what_it_counted_at_the_end_of_a_request() -> None:
    """`request_finished` flushes (wired in the app's `ready()`): a request that counted something
    (a start a quota refused, a cancel) leaves it in the database, scraped or not."""
    metric_counts.count(RUNS_FINISHED, {"workflow": "w", "status": "cancelled"})
    assert not MetricCount.objects.exists()
    assert Client().get("/metrics/").status_code == 401  # any request; this one reads nothing
    assert metric_counts.pending() == {}
    assert list(MetricCount.objects.values_list("metric", "value")) == [(RUNS_FINISHED, 1.0)]
