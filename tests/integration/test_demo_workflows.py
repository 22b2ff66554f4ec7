"""The demo's per-key step concurrency story (`make demo` runs it with every burst): one
customer's export steps execute one at a time, across that customer's runs, while another
customer's go on beside them."""

from __future__ import annotations

from django.db.models import Count

from durable_flow import start
from durable_flow.admission.db.backend import DatabaseAdmissionBackend
from durable_flow.engine import Engine
from durable_flow.models import RunStatus, StepCheckpoint, StepKind, StepStatus, WorkflowRun
from examples import exports  # noqa: F401  (registers the demo's customer exports)
from tests.engine_support import transport_of


def executing_by_customer() -> dict[str, int]:
    rows = (
        StepCheckpoint.objects.filter(kind=StepKind.STEP, status=StepStatus.DISPATCHED)
        .values_list("run__input__customer_id")
        .annotate(n=Count("id"))
    )
    return dict(rows)


def test_one_customers_exports_take_turns_while_another_customers_run_beside_them(manual: Engine) -> None:
    manual.admission = DatabaseAdmissionBackend()
    transport = transport_of(manual)
    transport.bind(manual)
    runs = [start("examples.customer_export", {"customer_id": c, "seconds": 0}) for c in ("cust-7", "cust-7", "cust-9")]
    transport.run_turns()
    assert executing_by_customer() == {"cust-7": 1, "cust-9": 1}
    peaks: dict[str, int] = {}

    def watch(_: object) -> None:
        for customer, n in executing_by_customer().items():
            peaks[customer] = max(peaks.get(customer, 0), n)

    transport.run_all(on_step=watch)
    assert peaks == {"cust-7": 1, "cust-9": 1}
    assert WorkflowRun.objects.filter(pk__in=[r.id for r in runs], status=RunStatus.COMPLETED).count() == 3
