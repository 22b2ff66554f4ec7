"""The dashboard's queue numbers come from the admission backend, so they are right under
`local`, `db` and `redis` alike: the same scenario, three backends."""

from __future__ import annotations

from durable_flow import start
from durable_flow.admission.base import AdmissionBackend
from durable_flow.config.queues import QueueConfig, RateLimit
from durable_flow.config.settings import get_settings
from durable_flow.engine import Engine, set_engine
from durable_flow.observe.queues import queue_rows
from tests.engine_support import ManualTransport


def test_queue_row_counts_in_flight_waiting_and_window_use(
    admission_backend: AdmissionBackend, transactional_db: None
) -> None:
    transport = ManualTransport()
    engine = Engine(admission=admission_backend, transport=transport, settings=get_settings())
    set_engine(engine)
    engine.register_queue(
        QueueConfig.build(name="render", concurrency=1, rate_limit=RateLimit(limit=10, period_ms=3_600_000))
    )
    engine.register_queue(QueueConfig.build(name="idle", concurrency=2))
    for value in range(3):
        start("tests.queued", {"queue": "render", "value": value})
    transport.run_turns()
    assert len(transport.steps) == 1  # one admitted; two blocked behind the cap

    rows = {row["name"]: row for row in queue_rows()}
    render, idle = rows["render"], rows["idle"]
    # The window counts step starts: admitted is not started yet.
    assert (render["in_flight"], render["waiting"], render["window_used"]) == (1, 2, 0)
    assert (idle["in_flight"], idle["waiting"], idle["window_used"]) == (0, 0, None)

    # The admitted step starts (counted in the window) and finishes: its slot is handed to the
    # first waiter, whose step is dispatched; one call is still waiting.
    transport.execute(transport.take())
    render = {row["name"]: row for row in queue_rows()}["render"]
    assert (render["in_flight"], render["waiting"], render["window_used"]) == (1, 1, 1)
    assert len(transport.steps) == 1
