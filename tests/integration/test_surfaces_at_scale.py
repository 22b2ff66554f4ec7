"""The operator surfaces stay cheap on a long history: the run lists page by keyset (no run lost
or shown twice while runs start between pages, no COUNT over the runs), search the run id by
prefix, filter tags by containment and queues by EXISTS (never a DISTINCT), the overview counts
only live runs, a queue's parked calls are counted up to a cap, and on PostgreSQL each of the
time windows and filters is answered by an index (`enable_seqscan = off`: a plan that still
scans the table has no usable index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from durable_flow import start
from durable_flow.contrib.admin_run_list import COUNT_CAP, CappedCountPaginator
from durable_flow.engine import Engine
from durable_flow.exceptions import InvalidInput
from durable_flow.models import (
    FlowQueue,
    QueueSample,
    RunStatus,
    StepCheckpoint,
    StepStatus,
    WorkflowRun,
)
from durable_flow.observe import run_filters
from durable_flow.observe.overview import overview
from durable_flow.observe.queues import gauges as queue_gauges
from durable_flow.observe.run_filters import RunFilterForm, filtered_runs
from durable_flow.observe.run_pages import PAGE_SIZE, run_page
from durable_flow.observe.runs import run_counts
from durable_flow.observe.sampling import Parked, parked_calls
from durable_flow.operations import api
from durable_flow.store import sampling as sampling_store
from tests.engine_support import transport_of

postgresql_only = pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="a plan of PostgreSQL's (the SQLite pass has no such index)"
)


@pytest.fixture
def boss(transactional_db: None) -> Client:
    user = get_user_model().objects.create_user("boss", password="pw", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    return client


def make_run(run_id: str, at: Any, status: str = RunStatus.COMPLETED, **fields: Any) -> WorkflowRun:
    run = WorkflowRun.objects.create(id=run_id, workflow="tests.three_steps", status=status, **fields)
    WorkflowRun.objects.filter(pk=run_id).update(created_at=at)  # auto_now_add: set after
    return run


def checkpoint(run_id: str, key: str, queue: str = "", **fields: Any) -> StepCheckpoint:
    return StepCheckpoint.objects.create(
        run_id=run_id, key=key, sequence=int(key), name="tests.step", queue=queue, **fields
    )


def walk(runs: Any, between: Any = None) -> list[str]:
    """Every run id, page after page by the `older` cursor; `between(n)` runs after page n."""
    seen: list[str] = []
    page = run_page(runs)
    n = 0
    while True:
        seen += [run.pk for run in page.runs]
        if page.older is None:
            return seen
        n += 1
        if between:
            between(n)
        page = run_page(runs, after=page.older)


def test_keyset_pages_lose_and_repeat_no_run_while_runs_start_between_pages(transactional_db: None) -> None:
    now = timezone.now()
    # Ties on created_at (five runs a millisecond) cross the page boundaries.
    for i in range(2 * PAGE_SIZE + 17):
        make_run(f"r{i:04d}", now - timedelta(milliseconds=i // 5))
    existing = set(WorkflowRun.objects.values_list("pk", flat=True))

    def start_more(n: int) -> None:
        for j in range(7):  # newer than every listed run: they belong before the first page
            make_run(f"new-{n}-{j}", now + timedelta(seconds=n, milliseconds=j))

    seen = walk(filtered_runs({}), start_more)
    assert len(seen) == len(set(seen)), "a run was shown twice"
    assert set(seen) == existing, "a run was lost"
    # Newest first, ties by id: the order the pages promise.
    order = list(WorkflowRun.objects.filter(pk__in=existing).order_by("-created_at", "pk").values_list("pk", flat=True))
    assert seen == order


def test_a_page_before_a_cursor_is_the_page_that_came_before(transactional_db: None) -> None:
    now = timezone.now()
    for i in range(3 * PAGE_SIZE):
        make_run(f"r{i:04d}", now - timedelta(milliseconds=i // 3))
    runs = filtered_runs({})
    first = run_page(runs)
    second = run_page(runs, after=first.older)
    third = run_page(runs, after=second.older)
    assert first.newer is None and third.older is None
    back = run_page(runs, before=third.newer)
    assert [r.pk for r in back.runs] == [r.pk for r in second.runs]
    assert back.older == second.older and back.newer == second.newer
    assert [r.pk for r in run_page(runs, before=back.newer).runs] == [r.pk for r in first.runs]
    assert run_page(runs, before=back.newer).newer is None


def test_a_bad_cursor_is_a_400(boss: Client) -> None:
    for params in ({"after": "yesterday"}, {"before": "2026-01-01T00:00:00~x", "after": "2026-01-01T00:00:00~y"}):
        assert boss.get(reverse("dashboard:runs"), params).status_code == 400


def test_the_run_list_pages_by_link_without_counting_the_runs(boss: Client) -> None:
    now = timezone.now()
    for i in range(PAGE_SIZE + 3):
        make_run(f"p-{i:03d}", now - timedelta(seconds=i))
    url = reverse("dashboard:runs")
    with CaptureQueriesContext(connection) as queries:
        first = boss.get(url).content.decode()
    run_queries = [q["sql"] for q in queries.captured_queries if "durable_flow_workflowrun" in q["sql"]]
    assert run_queries and not any("COUNT(" in sql.upper() for sql in run_queries), run_queries
    assert 'data-run="p-000"' in first and 'data-run="p-052"' not in first
    older = first.split('rel="next"')[0].rsplit('href="', 1)[1].split('"')[0].replace("&amp;", "&")
    second = boss.get(url + older).content.decode()
    assert 'data-run="p-052"' in second and 'data-run="p-000"' not in second
    assert 'rel="prev"' in second and 'rel="next"' not in second
    # A list that fits a page says how many runs match.
    assert '<b id="match-count">1</b> matching run' in boss.get(url, {"q": "p-052"}).content.decode()


def test_the_id_search_is_a_case_sensitive_prefix_and_inputs_only_when_asked(transactional_db: None) -> None:
    now = timezone.now()
    make_run("order-17", now, input={"customer": "ACME"})
    make_run("reorder-17", now, input={"customer": "order-17's twin"})
    make_run("Order-18", now)

    def found(**data: Any) -> set[str]:
        form = RunFilterForm(data)
        assert form.is_valid(), form.errors
        return set(filtered_runs(form.cleaned_data).values_list("pk", flat=True))

    # Not inside another id; on PostgreSQL not in another case either (SQLite's LIKE ignores
    # the case of ASCII letters).
    assert found(q="order-1") - {"Order-18"} == {"order-17"}
    if connection.vendor == "postgresql":
        assert found(q="order-1") == {"order-17"}
    assert found(q="order-17", in_input=True) == {"order-17", "reorder-17"}
    assert found(q="acme", in_input=True) == {"order-17"}  # inside the inputs: any case
    assert found(q="acme") == set()


def test_tags_match_by_containment_not_by_text(transactional_db: None) -> None:
    now = timezone.now()
    make_run("both", now, tags=["vip", "eu"])
    make_run("longer", now, tags=["vip-gold"])
    make_run("none", now, tags=[])
    make_run("quoted", now, tags=['say "vip"'])
    assert set(filtered_runs({"tag": "vip"}).values_list("pk", flat=True)) == {"both"}
    assert set(filtered_runs({"tag": "eu"}).values_list("pk", flat=True)) == {"both"}
    assert run_filters.runs_from_json({"tag": "vip-gold"}).get().pk == "longer"


def test_the_admin_queue_filter_is_an_exists_probe_and_lists_a_run_once(boss: Client) -> None:
    FlowQueue.objects.create(name="imports", config={"name": "imports"})
    now = timezone.now()
    make_run("twice-on-imports", now)
    checkpoint("twice-on-imports", "0", "imports")
    checkpoint("twice-on-imports", "1", "imports")
    make_run("elsewhere", now)
    checkpoint("elsewhere", "0", "exports")
    url = reverse("admin:durable_flow_workflowrun_changelist")
    with CaptureQueriesContext(connection) as queries:
        page = boss.get(url, {"queue": "imports"}).content.decode()
    assert page.count('href="/admin/durable_flow/workflowrun/twice-on-imports/change/') == 1
    assert "elsewhere" not in page
    run_queries = [q["sql"].upper() for q in queries.captured_queries if "DURABLE_FLOW_WORKFLOWRUN" in q["sql"].upper()]
    assert any("EXISTS" in sql for sql in run_queries)
    assert not any("DISTINCT" in sql for sql in run_queries), run_queries
    # The choices come from the queue table and the registry, not from the runs.
    assert "queue=imports" in page and "workflow=tests.three_steps" in page


def test_the_admin_search_matches_an_id_prefix_or_a_key_exactly(boss: Client) -> None:
    now = timezone.now()
    make_run("import-2026-12", now)
    make_run("re-import-2026-12", now, concurrency_key="cust-7")
    url = reverse("admin:durable_flow_workflowrun_changelist")

    def listed(term: str) -> set[str]:
        page = boss.get(url, {"q": term}).content.decode()
        return {rid for rid in ("import-2026-12", "re-import-2026-12") if f"/workflowrun/{rid}/change/" in page}

    assert listed("import-2026") == {"import-2026-12"}
    if connection.vendor == "postgresql":  # SQLite's LIKE ignores the case of ASCII letters
        assert listed("IMPORT-2026") == set()
    assert listed("cust-7") == {"re-import-2026-12"}
    assert listed("cust-") == set()  # keys exactly


def test_the_admin_count_stops_at_its_cap(transactional_db: None) -> None:
    WorkflowRun.objects.bulk_create(
        WorkflowRun(id=f"c{i:05d}", workflow="tests.three_steps", status=RunStatus.COMPLETED)
        for i in range(COUNT_CAP + 5)
    )
    assert CappedCountPaginator(WorkflowRun.objects.all(), 50).count == COUNT_CAP
    assert CappedCountPaginator(WorkflowRun.objects.filter(pk__startswith="c0000"), 50).count == 10
    with CaptureQueriesContext(connection) as queries:
        assert CappedCountPaginator(WorkflowRun.objects.all(), 50).count == COUNT_CAP
    assert f"LIMIT {COUNT_CAP}" in queries.captured_queries[0]["sql"]


def test_the_overview_counts_live_runs_only_and_shows_finished_ones_as_links(boss: Client) -> None:
    now = timezone.now()
    make_run("done", now)
    make_run("broken", now, status=RunStatus.FAILED)
    make_run("busy", now, status=RunStatus.RUNNING)
    assert run_counts() == {"pending": 0, "debounced": 0, "running": 1, "suspended": 0, "cancelling": 0}
    with CaptureQueriesContext(connection) as queries:
        overview(now)
    run_queries = [q["sql"] for q in queries.captured_queries if 'FROM "durable_flow_workflowrun"' in q["sql"]]
    for sql in run_queries:
        where = sql.split("WHERE", 1)[-1]
        assert '"status" IN' in where or '"status" =' in where, f"a count over every run: {sql}"
    html = boss.get(reverse("dashboard:index")).content.decode()
    assert 'aria-label="1 running runs"' in html
    assert 'aria-label="completed runs"' in html and "?status=completed" in html
    # Each live status counted up to the cap: a long backlog costs what the cap does.
    assert run_counts(cap=1)["running"] == 1
    make_run("busy-too", now, status=RunStatus.RUNNING)
    assert run_counts(cap=1)["running"] == 1 and run_counts()["running"] == 2


def test_a_queue_s_parked_calls_are_counted_up_to_the_cap(transactional_db: None) -> None:
    now = timezone.now()
    for i in range(5):
        make_run(f"w{i}", now, status=RunStatus.RUNNING)
        cp = checkpoint(f"w{i}", "0", "imports", status=StepStatus.WAITING)
        StepCheckpoint.objects.filter(pk=cp.pk).update(created_at=now - timedelta(seconds=i))
    line = parked_calls(["imports", "exports"], cap=3)
    assert set(line) == {"imports"}
    assert line["imports"].n == 3 and line["imports"].capped
    assert line["imports"].oldest == now - timedelta(seconds=4)
    assert parked_calls(["imports"], cap=None)["imports"] == Parked(5, now - timedelta(seconds=4), capped=False)


def test_the_metrics_count_each_line_whole_past_the_pages_cap(transactional_db: None) -> None:
    """`durable_flow_queue_waiting` is exact (an autoscaler reads it): past the cap the pages
    stop at, and only parked calls, per queue."""
    now = timezone.now()
    FlowQueue.objects.create(name="imports", config={"name": "imports"})
    FlowQueue.objects.create(name="exports", config={"name": "exports"})
    for i in range(5):
        make_run(f"w{i}", now, status=RunStatus.RUNNING)
        checkpoint(f"w{i}", "0", "imports", status=StepStatus.WAITING)
    make_run("held", now, status=RunStatus.RUNNING)
    checkpoint("held", "0", "imports", status=StepStatus.DISPATCHED)
    assert parked_calls(["imports"], cap=3)["imports"].capped
    waiting = {gauge["name"]: gauge["waiting"] for gauge in queue_gauges()}
    assert waiting == {"imports": 5, "exports": 0}


# --- PostgreSQL: each surface's statement has an index ------------------------------------------


@pytest.fixture
def no_seqscan(transactional_db: None) -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET enable_seqscan")


def plan(queryset: Any) -> str:
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


def scans(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "Seq Scan on durable_flow_" in line]


@postgresql_only
def test_postgresql_counts_the_metrics_lines_on_the_index_of_parked_calls(no_seqscan: None) -> None:
    now = timezone.now()
    for i in range(300):
        make_run(f"m{i}", now, status=RunStatus.RUNNING if i % 3 == 0 else RunStatus.COMPLETED)
        status = StepStatus.WAITING if i % 3 == 0 else StepStatus.COMPLETED
        checkpoint(f"m{i}", "0", "imports" if i % 2 else "exports", status=status)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE durable_flow_stepcheckpoint")
    with CaptureQueriesContext(connection) as queries:
        FlowQueue.objects.create(name="imports", config={"name": "imports"})
        queue_gauges()
    (count,) = [q["sql"] for q in queries.captured_queries if "COUNT(*)" in q["sql"] and "waiting" in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {count}")
        text = "\n".join(row[0] for row in cursor.fetchall())
    assert "on df_checkpoint_waiting" in text, text  # index-only once vacuumed


@postgresql_only
def test_postgresql_answers_the_sampler_s_windows_from_indexes(no_seqscan: None) -> None:
    FlowQueue.objects.create(name="imports", config={"name": "imports"})
    now = timezone.now()
    sql, params = sampling_store.figures_statement(now - timedelta(seconds=10), now, 10)
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        text = "\n".join(row[0] for row in cursor.fetchall())
    for index in (
        "df_checkpoint_status_disp",
        "df_checkpoint_settled",
        "df_attempt_failed_at",
        "df_checkpoint_queue_line",
    ):
        assert index in text, text
    assert not [scan for scan in scans(text) if "flowqueue" not in scan], text  # a handful of rows


def test_the_sampler_s_no_queue_in_flight_count_is_the_dispatched_steps_only(manual: Engine, clock: Any) -> None:
    """Through the engine's own dispatches: the steps in flight on no queue count, and nothing
    else that is `dispatched` on no queue (a sleep, a signal wait, a child run) or in flight on a
    queue does."""
    api.register_queue("sampled", concurrency=2)
    start("tests.three_steps", 1)  # its first step, on no queue
    start("tests.child_parent", 2)  # the parent waits on its child, whose first step is in flight
    start("tests.sleeper", 3600)
    start("tests.signal_waiter", None)
    start("tests.queued", {"queue": "sampled", "value": 0})
    transport_of(manual).run_turns()
    dispatched = StepCheckpoint.objects.filter(status=StepStatus.DISPATCHED)
    assert sorted(dispatched.values_list("kind", "queue")) == [
        ("child", ""),
        ("signal", ""),
        ("sleep", ""),
        ("step", ""),
        ("step", ""),
        ("step", "sampled"),
    ]
    now = clock()
    assert sampling_store.queue_figures(now - timedelta(seconds=10), now, 10).ungated_in_flight == 2


def rows_removed(plan: Any, table: str) -> int:
    """The rows of `table` an `EXPLAIN (ANALYZE, FORMAT JSON)` plan read and left out."""
    removed = 0
    if plan.get("Relation Name") == table:
        removed += plan.get("Rows Removed by Filter", 0) + plan.get("Rows Removed by Index Recheck", 0)
    return removed + sum(rows_removed(child, table) for child in plan.get("Plans", ()))


@postgresql_only
def test_the_sampler_reads_no_sleep_or_signal_wait_to_count_the_steps_in_flight(no_seqscan: None) -> None:
    """The sleeps and signal waits are `dispatched` on no queue too, as many as the runs asleep;
    the count of the steps in flight on no queue reads none of their rows to leave them out."""
    now = timezone.now()
    make_run("asleep", now, status=RunStatus.SUSPENDED)
    StepCheckpoint.objects.bulk_create(
        StepCheckpoint(
            run_id="asleep",
            key=str(n),
            sequence=n,
            kind="sleep" if n % 2 else "signal",
            name="sleep",
            status=StepStatus.DISPATCHED,
        )
        for n in range(300)
    )
    make_run("busy", now, status=RunStatus.RUNNING)
    for key in ("0", "1"):
        checkpoint("busy", key, status=StepStatus.DISPATCHED, dispatched_at=now)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE durable_flow_stepcheckpoint")
        sql, params = sampling_store.figures_statement(
            now - timedelta(hours=1, seconds=10), now - timedelta(hours=1), 10
        )
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    assert rows_removed(plan[0]["Plan"], StepCheckpoint._meta.db_table) == 0, json.dumps(plan, indent=1)
    assert sampling_store.queue_figures(now - timedelta(seconds=10), now, 10).ungated_in_flight == 2


@postgresql_only
def test_the_samples_commit_waits_for_no_wal_flush_and_leaves_a_caller_s_transaction_as_it_was(
    transactional_db: None,
) -> None:
    """The samples' own commit does not wait for the WAL to reach the disk; inside a caller's
    transaction the write leaves the caller's setting (its other writes) as they were."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMPORARY TABLE seen_commit (setting text)")
        cursor.execute(
            "CREATE FUNCTION df_test_seen_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "INSERT INTO seen_commit VALUES (current_setting('synchronous_commit')); RETURN NULL; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER df_test_seen_commit AFTER INSERT ON durable_flow_queuesample "
            "FOR EACH ROW EXECUTE FUNCTION df_test_seen_commit()"
        )
    try:
        now = timezone.now()
        sampling_store.write_samples(now, 10.0, [("", 0, 1, 0, 0, 0, 0)], now)
        with transaction.atomic():
            sampling_store.write_samples(now + timedelta(seconds=10), 10.0, [("", 0, 2, 0, 0, 0, 0)], now)
            with connection.cursor() as cursor:
                cursor.execute("SHOW synchronous_commit")
                assert cursor.fetchone()[0] == "on"
        with connection.cursor() as cursor:
            cursor.execute("SELECT setting FROM seen_commit")
            assert [row[0] for row in cursor.fetchall()] == ["off", "on"]
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone()[0] == "on"  # for its own transaction only
        assert sorted(QueueSample.objects.values_list("in_flight", flat=True)) == [1, 2]
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER df_test_seen_commit ON durable_flow_queuesample")
            cursor.execute("DROP FUNCTION df_test_seen_commit()")
            cursor.execute("DROP TABLE seen_commit")


@postgresql_only
def test_postgresql_answers_the_run_filters_from_indexes(no_seqscan: None) -> None:
    for data, index in (
        ({"tag": "vip"}, "df_run_tags"),
        ({"q": "order-1"}, "_like"),  # the primary key's pattern index
        ({"status": ["failed"]}, "df_run_status_wake"),
    ):
        text = plan(filtered_runs(data).order_by())
        assert index in text and not scans(text), text
    text = plan(filtered_runs({"q": "acme", "in_input": True}).order_by())
    has_trigrams = WorkflowRun.objects.raw("SELECT 1 AS id FROM pg_indexes WHERE indexname = 'df_run_input_trgm'")
    if list(has_trigrams):
        assert "df_run_input_trgm" in text and not scans(text), text


def test_the_api_filter_searches_inputs_only_when_asked(transactional_db: None) -> None:
    make_run("order-17", timezone.now(), input={"customer": "ACME"})
    assert not run_filters.runs_from_json({"q": "acme"}).exists()
    assert run_filters.runs_from_json({"q": "acme", "in_input": True}).get().pk == "order-17"
    with pytest.raises(InvalidInput, match="in_input"):
        run_filters.runs_from_json({"q": "acme", "in_input": "yes"})
