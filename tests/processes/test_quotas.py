"""Start quotas: a start over its key's limit is refused at once and creates nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.test import Client, RequestFactory

from durable_flow import ConcurrencyLimitError, RegistrationError, workflow
from durable_flow.contrib.http import quota_limited
from durable_flow.engine import Engine
from durable_flow.exceptions import InvalidQuota
from durable_flow.models import QuotaRefusal, RunStatus, StepCheckpoint, Task, WorkflowRun
from durable_flow.operations import api
from durable_flow.store.quotas import count_active
from tests.conftest import ManagedProcess, MovableClock, wait_for
from tests.engine_support import ManualTransport, transport_of
from tests.support.clients import logged_in_client


def tenant_key(input: dict[str, Any]) -> str | None:
    tenant = input.get("tenant")
    return None if tenant is None else f"tenant:{tenant}"


@workflow("quota.turn", quota={"key": tenant_key, "limit": 2})
def turn(ctx: Any, input: dict[str, Any]) -> Any:
    """Holds its slot until signalled: `fail` fails the run, anything else completes it."""
    verdict = ctx.wait_for_signal("go")
    if verdict == "fail":
        raise RuntimeError("told to fail")
    return verdict


@workflow("quota.narrow", quota={"key": tenant_key, "limit": 1, "count_statuses": ["pending", "running"]})
def narrow(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


@workflow(
    "quota.cel",
    quota={"key": 'has(input.tenant) ? "tenant:" + input.tenant : null', "limit": 1},
)
def cel_keyed(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


PLAN_LIMITS = {"tenant:free": 1, "tenant:pro": 3}


@workflow("quota.sync_limit", quota={"key": tenant_key, "limit": lambda key: PLAN_LIMITS[key]})
def sync_limit(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


async def async_plan_limit(key: str) -> int:
    return PLAN_LIMITS[key]


@workflow("quota.async_limit", quota={"key": tenant_key, "limit": async_plan_limit})
def async_limit(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


@workflow("quota.closed", quota={"key": tenant_key, "limit": 0})
def closed(ctx: Any, input: dict[str, Any]) -> Any:
    return "never"


def strict_tenant_key(input: dict[str, Any]) -> str:
    return f"tenant:{input['tenant']}"  # a KeyError on an input without a tenant


@workflow("quota.strict", quota={"key": strict_tenant_key, "limit": 1})
def strict(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


@workflow("quota.huge_limit", quota={"key": tenant_key, "limit": lambda key: 10**30})
def huge_limit(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


@workflow("quota.unlimited")
def unlimited(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


@workflow("quota.child", quota={"key": lambda payload: f"child:{payload['tenant']}", "limit": 1})
def quota_child(ctx: Any, input: dict[str, Any]) -> Any:
    return ctx.wait_for_signal("go")


@workflow("quota.parent")
def quota_parent(ctx: Any, input: dict[str, Any]) -> Any:
    try:
        result = ctx.child(quota_child, {"tenant": input["tenant"]})
    except ConcurrencyLimitError as exc:
        if not input.get("catch"):
            raise
        result = f"refused {exc.key} at {exc.active}/{exc.limit}"
    ctx.wait_for_signal("done")
    return result


@workflow("quota.fan_parent")
def quota_fan_parent(ctx: Any, tenant: str) -> Any:
    return ctx.all(quota_child, [{"tenant": tenant}, {"tenant": tenant}])


def start(name: str, tenant: str | None, run_id: str | None = None, **kwargs: Any) -> WorkflowRun:
    return api.start(name, {} if tenant is None else {"tenant": tenant}, run_id=run_id, **kwargs)


def refused(name: str, tenant: str | None, **kwargs: Any) -> ConcurrencyLimitError:
    with pytest.raises(ConcurrencyLimitError) as info:
        start(name, tenant, **kwargs)
    return info.value


def status(run_id: str) -> str:
    return WorkflowRun.objects.get(pk=run_id).status


def test_a_full_quota_refuses_the_next_start_and_creates_nothing(engine: Engine) -> None:
    start("quota.turn", "acme", "a1")
    start("quota.turn", "acme", "a2")
    rows = (WorkflowRun.objects.count(), StepCheckpoint.objects.count(), Task.objects.count())
    exc = refused("quota.turn", "acme", run_id="a3")
    assert (exc.key, exc.limit, exc.active, exc.workflow) == ("tenant:acme", 2, 2, "quota.turn")
    assert not WorkflowRun.objects.filter(pk="a3").exists()
    assert (WorkflowRun.objects.count(), StepCheckpoint.objects.count(), Task.objects.count()) == rows


def test_the_run_carries_its_key_and_tag(engine: Engine) -> None:
    run = start("quota.turn", "acme", "a1", tags=["mine"])
    run.refresh_from_db()
    assert run.concurrency_key == "tenant:acme"
    assert run.tags == ["mine", "concurrency:tenant:acme"]


def test_keys_are_separate_buckets(engine: Engine) -> None:
    start("quota.turn", "acme")
    start("quota.turn", "acme")
    start("quota.turn", "globex")
    assert count_active("tenant:acme") == 2 and count_active("tenant:globex") == 1


def test_the_key_is_global_across_workflows(engine: Engine) -> None:
    start("quota.turn", "acme")
    start("quota.turn", "acme")
    exc = refused("quota.unlimited", None, quota={"key": "tenant:acme", "limit": 2})
    assert exc.workflow == "quota.unlimited" and exc.active == 2


def test_an_idempotent_restart_is_never_refused(engine: Engine) -> None:
    first = start("quota.turn", "acme", "a1")
    start("quota.turn", "acme", "a2")
    again = start("quota.turn", "acme", "a1")
    assert again.pk == first.pk
    assert WorkflowRun.objects.count() == 2


@pytest.mark.parametrize("ending", ["complete", "fail", "cancel"])
def test_a_slot_frees_when_a_run_ends(engine: Engine, ending: str) -> None:
    start("quota.turn", "acme", "a1")
    start("quota.turn", "acme", "a2")
    refused("quota.turn", "acme")
    if ending == "cancel":
        api.cancel("a1")
    else:
        api.send_signal("a1", "go", "fail" if ending == "fail" else "ok")
    assert (
        status("a1")
        == {"complete": RunStatus.COMPLETED, "fail": RunStatus.FAILED, "cancel": RunStatus.CANCELLED}[ending]
    )
    assert start("quota.turn", "acme", "a3").concurrency_key == "tenant:acme"


def test_count_statuses_narrowing_lets_suspended_runs_stop_counting(engine: Engine) -> None:
    start("quota.narrow", "acme", "n1")
    assert status("n1") == RunStatus.SUSPENDED  # parked on a signal: not counted
    start("quota.narrow", "acme", "n2")
    assert count_active("tenant:acme", ["pending", "running"]) == 0


def test_count_statuses_narrowing_still_counts_pending_runs(manual: Engine) -> None:
    start("quota.narrow", "acme", "n1")  # its first turn is queued, not run: pending
    exc = refused("quota.narrow", "acme")
    assert exc.active == 1


@pytest.fixture(params=["local", "db"])
def manual_on(request: pytest.FixtureRequest, clock: MovableClock, transactional_db: None) -> Engine:
    """A `ManualTransport` engine (a step stays in flight until the test runs it) on `local` or
    `db` admission."""
    from durable_flow.admission.db.backend import DatabaseAdmissionBackend
    from durable_flow.admission.local import LocalAdmissionBackend
    from durable_flow.config.settings import get_settings
    from durable_flow.engine import set_engine

    admission = (
        LocalAdmissionBackend(clock=lambda: clock.ms)
        if request.param == "local"
        else DatabaseAdmissionBackend(clock=lambda: clock.ms)
    )
    engine = Engine(admission=admission, transport=ManualTransport(), settings=get_settings(), clock=clock)
    set_engine(engine)
    return engine


def test_a_cancelling_run_holds_its_slot_until_it_is_cancelled(manual_on: Engine) -> None:
    """`cancelling` is among the counted statuses: a run cancelled mid-step still counts until its
    step's result lands and it becomes `cancelled`; then the slot is free."""
    transport = transport_of(manual_on)
    solo = {"key": "solo", "limit": 1}
    run = api.start("tests.three_steps", 1, quota=solo)
    transport.run_turns()
    job = transport.take("1")
    assert api.cancel(run.pk).status == RunStatus.CANCELLING
    with pytest.raises(ConcurrencyLimitError) as info:
        api.start("tests.three_steps", 2, quota=solo)
    assert (info.value.active, info.value.limit) == (1, 1)
    assert WorkflowRun.objects.filter(concurrency_key="solo").count() == 1
    transport.execute(job)
    assert status(run.pk) == RunStatus.CANCELLED
    assert api.start("tests.three_steps", 2, quota=solo).concurrency_key == "solo"


def test_a_workflows_string_key_is_a_cel_expression_over_the_input(engine: Engine) -> None:
    run = start("quota.cel", "acme")
    assert WorkflowRun.objects.get(pk=run.pk).concurrency_key == "tenant:acme"
    assert refused("quota.cel", "acme").key == "tenant:acme"
    start("quota.cel", "globex")
    start("quota.cel", None)  # null key: unlimited
    start("quota.cel", None)


def test_a_cel_key_that_fails_on_the_input_is_a_typed_error(engine: Engine) -> None:
    with pytest.raises(InvalidQuota):
        api.start("quota.cel", {"tenant": 7})  # a string plus an int
    assert not WorkflowRun.objects.exists()


@pytest.mark.parametrize("name", ["quota.sync_limit", "quota.async_limit"])
def test_limit_may_be_a_sync_or_async_callable_of_the_key(engine: Engine, name: str) -> None:
    start(name, "free")
    assert refused(name, "free").limit == 1
    for _ in range(3):
        start(name, "pro")
    assert refused(name, "pro").limit == 3


def test_a_workflows_limit_of_zero_refuses_every_start(engine: Engine) -> None:
    exc = refused("quota.closed", "acme")
    assert (exc.limit, exc.active) == (0, 0)
    assert not WorkflowRun.objects.exists()


def test_a_none_key_leaves_the_start_unlimited(engine: Engine) -> None:
    runs = [start("quota.turn", None) for _ in range(4)]
    assert all(WorkflowRun.objects.get(pk=run.pk).concurrency_key is None for run in runs)


def test_a_per_start_quota_overrides_the_workflows(engine: Engine) -> None:
    for _ in range(3):
        start("quota.turn", "acme", quota={"key": "tenant:acme", "limit": 3})
    assert refused("quota.turn", "acme", quota={"key": "tenant:acme", "limit": 3}).limit == 3
    start("quota.unlimited", None, quota={"key": "solo", "limit": 1})
    assert refused("quota.unlimited", None, quota={"key": "solo", "limit": 1}).key == "solo"


@pytest.mark.parametrize(
    "quota",
    [
        {"key": "k"},
        {"key": 3, "limit": 1},
        {"key": "k", "limit": "8"},
        {"key": "k", "limit": 1, "count_statuses": ["running", "sleeping"]},
        {"key": "k", "limit": 1, "extra": True},
        {"key": "", "limit": 1},
        {"key": "k" * 201, "limit": 1},
        {"key": "a\x00", "limit": 1},
        {"key": "a\ud800", "limit": 1},
        {"key": "k", "limit": 0},
        {"key": "k", "limit": -1},
        {"key": "k", "limit": 2**31},
        {"key": "k", "limit": 10**30},
        {"key": "k", "limit": 1.0},
    ],
)
def test_a_bad_per_start_quota_is_a_typed_error(engine: Engine, quota: dict[str, Any]) -> None:
    with pytest.raises(InvalidQuota):
        start("quota.unlimited", None, quota=quota)
    assert not WorkflowRun.objects.exists()


def test_a_quota_key_function_that_raises_is_invalid_quota_with_its_cause(engine: Engine) -> None:
    with pytest.raises(InvalidQuota, match="quota key") as info:
        api.start("quota.strict", {})
    assert isinstance(info.value.__cause__, KeyError)
    assert not WorkflowRun.objects.exists()


def test_a_limit_callable_giving_more_than_the_column_holds_is_invalid_quota(engine: Engine) -> None:
    with pytest.raises(InvalidQuota, match="limit"):
        start("quota.huge_limit", "acme")
    assert not WorkflowRun.objects.exists()


@pytest.mark.parametrize(
    "quota",
    [
        {"key": '"tenant:" +', "limit": 1},
        {"key": tenant_key, "limit": True},
        {"key": tenant_key, "limit": -1},
        {"key": tenant_key, "limit": 2**31},
        {"limit": 1},
        ["key", "limit"],
    ],
)
def test_a_bad_workflow_quota_fails_registration_naming_the_workflow(quota: Any) -> None:
    with pytest.raises(RegistrationError, match=r"quota\.bad"):
        workflow("quota.bad", quota=quota)


def test_a_refused_child_fails_the_parent(engine: Engine) -> None:
    start("quota.child", "acme", "busy")
    run = start("quota.parent", "acme", "p1")
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error["type"].endswith("ConcurrencyLimitError")
    assert not WorkflowRun.objects.filter(parent_id="p1").exists()


def test_a_refused_child_can_be_caught_and_replays_the_same_refusal(engine: Engine) -> None:
    start("quota.child", "acme", "busy")
    api.start("quota.parent", {"tenant": "acme", "catch": True}, run_id="p2")
    assert status("p2") == RunStatus.SUSPENDED
    api.cancel("busy")  # the slot is free now, but the recorded refusal stands on replay
    api.send_signal("p2", "done")
    run = WorkflowRun.objects.get(pk="p2")
    assert run.status == RunStatus.COMPLETED
    assert run.output == "refused child:acme at 1/1"
    assert not WorkflowRun.objects.filter(parent_id="p2").exists()


def test_a_refused_child_in_a_fan_fails_the_parent_and_its_started_sibling_is_cancelled(engine: Engine) -> None:
    api.start("quota.fan_parent", "acme", run_id="f1")
    run = WorkflowRun.objects.get(pk="f1")
    assert run.status == RunStatus.FAILED and run.error["type"].endswith("ConcurrencyLimitError")
    assert [child.status for child in WorkflowRun.objects.filter(parent_id="f1")] == [RunStatus.CANCELLED]
    assert count_active("child:acme") == 0


def test_an_admitted_child_carries_the_key(engine: Engine) -> None:
    start("quota.parent", "acme", "p1")
    child = WorkflowRun.objects.get(parent_id="p1")
    assert child.concurrency_key == "child:acme" and "concurrency:child:acme" in child.tags


@pytest.fixture
def client(engine: Engine) -> Client:
    return logged_in_client("api", superuser=True)


def test_the_admin_shows_and_searches_a_runs_quota_key(client: Client) -> None:
    start("quota.turn", "acme", "a1")
    start("quota.turn", "globex", "globex-run")
    listing = client.get("/admin/durable_flow/workflowrun/", {"q": "tenant:acme"}).content.decode()
    assert "tenant:acme" in listing and "globex-run" not in listing
    assert "tenant:acme" in client.get("/admin/durable_flow/workflowrun/a1/change/").content.decode()


def test_the_json_api_answers_429_without_a_guessed_retry_after(client: Client) -> None:
    body = json.dumps({"workflow": "quota.turn", "input": {"tenant": "acme"}})
    for _ in range(2):
        assert client.post("/api/runs/", data=body, content_type="application/json").status_code == 201
    response = client.post("/api/runs/", data=body, content_type="application/json")
    assert response.status_code == 429
    assert "Retry-After" not in response  # the holders wait for a signal: when a slot frees is not known
    data = response.json()
    assert (data["key"], data["limit"], data["active"]) == ("tenant:acme", 2, 2)
    assert WorkflowRun.objects.count() == 2


def test_the_json_api_answers_400_when_a_quota_key_function_raises(client: Client) -> None:
    body = json.dumps({"workflow": "quota.strict", "input": {}})
    response = client.post("/api/runs/", data=body, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"] == "InvalidQuota"
    assert not WorkflowRun.objects.exists()


def test_quota_limited_maps_a_refusal_in_a_users_view_to_429(engine: Engine) -> None:
    @quota_limited
    def start_turn(request: HttpRequest) -> HttpResponse:
        run = start("quota.turn", "acme")
        return HttpResponse(run.pk, status=201)

    request = RequestFactory().post("/turns/")
    assert [start_turn(request).status_code for _ in range(3)] == [201, 201, 429]
    response = start_turn(request)
    assert response.status_code == 429 and json.loads(response.content)["active"] == 2


def test_racing_starts_on_the_last_slots_never_overshoot(engine: Engine) -> None:
    limit, starters = 3, 16
    barrier = threading.Barrier(starters)
    outcomes: list[str] = []
    lock = threading.Lock()

    def starter(n: int) -> None:
        try:
            barrier.wait(timeout=30)
            try:
                api.start("quota.unlimited", {}, run_id=f"race-{n}", quota={"key": "race", "limit": limit})
                outcome = "started"
            except ConcurrencyLimitError:
                outcome = "refused"
            with lock:
                outcomes.append(outcome)
        finally:
            connection.close()

    threads = [threading.Thread(target=starter, args=(n,)) for n in range(starters)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(outcomes) == ["refused"] * (starters - limit) + ["started"] * limit
    assert WorkflowRun.objects.filter(concurrency_key="race").count() == limit


def test_the_lock_is_per_key(engine: Engine) -> None:
    """A start on one key does not wait for an open start transaction on another key."""
    from django.db import transaction

    from durable_flow.store.quotas import lock_key

    if connection.vendor != "postgresql":
        pytest.skip("SQLite serialises every write transaction; per-key locks are PostgreSQL's")
    done = threading.Event()
    with transaction.atomic():
        lock_key("held")

        def other() -> None:
            try:
                start("quota.turn", "other")
                done.set()
            finally:
                connection.close()

        thread = threading.Thread(target=other)
        thread.start()
        assert done.wait(timeout=20)
        thread.join()


def test_a_worker_killed_mid_run_leaves_only_the_runs_own_status_counted(
    db_transport_engine: Engine, spawn: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    env = {"DURABLE_FLOW_TRANSPORT": "db", "DURABLE_FLOW_TEST_MARKER": str(marker)}
    solo = {"key": "solo", "limit": 1}
    run = api.start("tests.slow_one", {"id": "killed", "seconds": 2.0}, quota=solo)
    spawn("durable_poller", env=env)
    worker = spawn("durable_worker", "--concurrency", "2", env=env)
    wait_for(lambda: marker.exists() and "slow_start killed" in marker.read_text(), what="the step to start")
    worker.kill()  # SIGKILL, mid-step
    assert status(run.pk) == RunStatus.PENDING  # its first step ran optimistically: nothing written yet
    assert refused("tests.slow_one", None, quota=solo).active == 1  # counted by its status, nothing else
    spawn("durable_worker", "--concurrency", "2", env=env)
    wait_for(lambda: status(run.pk) == RunStatus.COMPLETED, timeout=120, what="run to complete")
    assert count_active("solo") == 0
    assert api.start("tests.slow_one", {"id": "next", "seconds": 0}, quota=solo).concurrency_key == "solo"


def test_the_dashboard_and_the_admin_show_each_keys_usage_and_refusals(engine: Engine) -> None:
    from durable_flow.observe.quotas import usage
    from durable_flow_dashboard.snapshot import snapshot

    start("quota.turn", "acme")
    start("quota.turn", "acme")
    start("quota.turn", "globex")
    refused("quota.turn", "acme")
    refused("quota.turn", "acme")
    refused("quota.closed", "initech")
    rows = {row["key"]: row for row in usage()}
    assert rows["tenant:acme"] == {"key": "tenant:acme", "active": 2, "limit": 2, "refused_per_min": 2}
    assert rows["tenant:globex"]["active"] == 1 and rows["tenant:globex"]["refused_per_min"] == 0
    # Nothing active: the limit it was refused at (0), not None.
    assert rows["tenant:initech"] == {"key": "tenant:initech", "active": 0, "limit": 0, "refused_per_min": 1}
    assert snapshot()["quotas"] == usage()

    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("quota-admin", password="pw"))
    response = admin.get("/admin/durable_flow/quotarefusal/")
    page = response.content.decode()
    assert "tenant:acme" in page and "tenant:initech" in page
    listed = {row.key: (row.active_runs, row.latest_limit) for row in response.context["cl"].result_list}
    assert listed == {"tenant:acme": (2, 2), "tenant:initech": (0, None)}
    dashboard = admin.get("/").content.decode()
    assert 'data-quota="tenant:acme"' in dashboard and "2 / 2" in dashboard


# -- retry: a run made active again takes a slot, through the same gate as a start --------------
def sleeper(tenant: str, run_id: str) -> WorkflowRun:
    return api.start("tests.quota_sleeper", {"tenant": tenant, "seconds": 600}, run_id=run_id)


def test_a_retry_over_the_quota_is_refused_and_changes_nothing(engine: Engine) -> None:
    sleeper("acme", "s1")
    api.cancel("s1")  # mid-sleep: its slot frees
    sleeper("acme", "s2")
    with pytest.raises(ConcurrencyLimitError) as info:
        api.retry("s1")
    assert (info.value.key, info.value.limit, info.value.active) == ("sleeper:acme", 1, 1)
    run = WorkflowRun.objects.get(pk="s1")
    assert (run.status, run.error["type"]) == (RunStatus.CANCELLED, "Cancelled")
    assert StepCheckpoint.objects.get(run=run).status == "cancelled"  # its sleep was not reset
    assert count_active("sleeper:acme") == 1
    assert QuotaRefusal.objects.get(key="sleeper:acme").refusals == 1
    api.cancel("s2")
    assert api.retry("s1").status == RunStatus.PENDING  # room now: it takes the slot
    assert status("s1") == RunStatus.SUSPENDED
    assert refused("tests.quota_sleeper", None, quota={"key": "sleeper:acme", "limit": 1}).active == 1


def test_retrying_a_parent_failed_by_a_refused_child_starts_the_child_once_there_is_room(engine: Engine) -> None:
    start("quota.child", "acme", "busy")
    start("quota.parent", "acme", "p1")
    assert status("p1") == RunStatus.FAILED
    api.cancel("busy")
    api.retry("p1")
    child = WorkflowRun.objects.get(parent_id="p1")
    assert (child.status, child.concurrency_key) == (RunStatus.SUSPENDED, "child:acme")
    api.send_signal(child.pk, "go", "child done")
    api.send_signal("p1", "done")
    run = WorkflowRun.objects.get(pk="p1")
    assert (run.status, run.output) == (RunStatus.COMPLETED, "child done")


def test_retrying_a_parent_failed_by_a_refused_child_while_the_quota_is_full_fails_it_the_same_way(
    engine: Engine,
) -> None:
    start("quota.child", "acme", "busy")
    start("quota.parent", "acme", "p1")
    api.retry("p1")
    run = WorkflowRun.objects.get(pk="p1")
    assert run.status == RunStatus.FAILED and run.error["type"].endswith("ConcurrencyLimitError")
    assert not WorkflowRun.objects.filter(parent_id="p1").exists()
    assert count_active("child:acme") == 1


def test_retrying_a_parent_that_caught_a_refusal_replays_the_refusal(engine: Engine) -> None:
    start("quota.child", "acme", "busy")
    api.start("quota.parent", {"tenant": "acme", "catch": True}, run_id="p2")
    api.cancel("p2")  # while waiting for "done", after it took the refusal
    api.cancel("busy")  # room now, but the parent's history says refused
    api.retry("p2")
    assert status("p2") == RunStatus.SUSPENDED
    api.send_signal("p2", "done")
    run = WorkflowRun.objects.get(pk="p2")
    assert (run.status, run.output) == (RunStatus.COMPLETED, "refused child:acme at 1/1")
    assert not WorkflowRun.objects.filter(parent_id="p2").exists()


def test_a_retry_over_the_quota_is_refused_with_a_real_worker(
    db_transport_engine: Engine, spawn: Callable[..., ManagedProcess]
) -> None:
    spawn("durable_worker", "--concurrency", "2", env={"DURABLE_FLOW_TRANSPORT": "db"})
    sleeper("acme", "w1")
    wait_for(lambda: status("w1") == RunStatus.SUSPENDED, timeout=60, what="w1 to sleep")
    api.cancel("w1")
    sleeper("acme", "w2")
    wait_for(lambda: status("w2") == RunStatus.SUSPENDED, timeout=60, what="w2 to sleep")
    with pytest.raises(ConcurrencyLimitError) as info:
        api.retry("w1")
    assert (info.value.limit, info.value.active) == (1, 1)
    assert status("w1") == RunStatus.CANCELLED and count_active("sleeper:acme") == 1
    api.cancel("w2")
    api.retry("w1")
    wait_for(lambda: status("w1") == RunStatus.SUSPENDED, timeout=60, what="the retried w1 to sleep again")
    assert refused("tests.quota_sleeper", None, quota={"key": "sleeper:acme", "limit": 1}).active == 1


def test_the_json_api_answers_429_to_a_retry_over_the_quota(client: Client) -> None:
    sleeper("acme", "h1")
    api.cancel("h1")
    sleeper("acme", "h2")
    response = client.post("/api/runs/h1/retry/")
    assert response.status_code == 429 and response.json()["active"] == 1
    assert status("h1") == RunStatus.CANCELLED


def test_a_parent_retry_that_would_put_its_child_over_the_quota_is_refused_and_changes_nothing(
    engine: Engine,
) -> None:
    start("quota.parent", "acme", "p1")
    child = WorkflowRun.objects.get(parent_id="p1")
    api.cancel(child.pk)  # the parent fails with its child call
    assert status("p1") == RunStatus.FAILED
    start("quota.child", "acme", "busy")  # takes the slot the child left
    with pytest.raises(ConcurrencyLimitError) as info:
        api.retry("p1")
    assert (info.value.key, info.value.active) == ("child:acme", 1)
    assert (status("p1"), status(child.pk)) == (RunStatus.FAILED, RunStatus.CANCELLED)
    assert StepCheckpoint.objects.get(run_id="p1").status == "failed"
