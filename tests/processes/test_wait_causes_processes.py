"""Wait causes recorded by real worker processes, on the two exact admission backends (`db`,
`redis`): calls parked behind a queue's cap say so while they wait (the run list filters them),
and each admitted attempt keeps the queue wait it had, for the timeline.

Runs on SQLite and, with DATABASE_URL set, on PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable

from durable_flow import register_queue, start
from durable_flow.engine import Engine
from durable_flow.models import StepAttempt, StepCheckpoint
from durable_flow.observe.run_filters import filtered_runs
from tests.conftest import ManagedProcess, wait_for
from tests.support.workers import completed, unique


def test_workers_record_a_cap_wait_while_parked_and_keep_it_on_the_attempt(
    matching_admission_engine: Engine, admission: str, process_env: dict[str, str], spawn: Callable[..., ManagedProcess]
) -> None:
    queue = unique("capped")
    register_queue(queue, concurrency=1)
    runs = [start("tests.queued", {"queue": queue, "seconds": 1.0, "id": i}).id for i in range(3)]
    for _ in range(2):
        spawn("durable_worker", "--concurrency", "2", env=process_env)
    spawn("durable_poller", "--interval-ms", "100", env=process_env)
    # While one step holds the cap, the others wait because of it, and the run list says so.
    parked = wait_for(
        lambda: set(filtered_runs({"waiting": "cap"}).values_list("pk", flat=True)), timeout=60, what="a capped wait"
    )
    assert parked <= set(runs)
    wait_for(lambda: completed(runs), timeout=120, what="the capped runs to complete")
    assert not filtered_runs({"waiting": "cap"}).exists()
    assert not StepCheckpoint.objects.filter(run_id__in=runs).exclude(wait_cause="").exists()  # all cleared
    waited = [a.waited for a in StepAttempt.objects.filter(run_id__in=runs)]
    capped = [w for w in waited if w]
    assert len(capped) >= len(parked) >= 1
    assert all(w["cause"] == "cap" and w["queue"] == queue for w in capped)
    if admission == "db":  # the database backend says the limit it decided with
        assert all(w["limit"] == 1 for w in capped)
