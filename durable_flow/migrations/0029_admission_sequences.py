"""PostgreSQL only: the sequences the `db` admission backend draws waiters' arrival numbers and
fairness serve numbers from, so that joining a queue's line or handing its slot to the next
waiter never writes (or waits for) the queue's row (`store/admission_statements.py`). Each
starts past every number a queue's row counted before, so the lines keep their order."""

from typing import Any

from django.db import migrations

ARRIVAL = "durable_flow_admission_arrival"
SERVE = "durable_flow_admission_serve"


def create_sequences(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    queues, waiters, served = (
        apps.get_model("durable_flow", name)._meta.db_table
        for name in ("FlowQueue", "AdmissionWaiter", "AdmissionKeyServed")
    )
    for name, counted in (
        (
            ARRIVAL,
            f"SELECT COALESCE(MAX(next_arrival), 0) FROM {queues} UNION ALL "
            f"SELECT COALESCE(MAX(arrival) + 1, 0) FROM {waiters}",
        ),
        (
            SERVE,
            f"SELECT COALESCE(MAX(next_serve), 0) FROM {queues} UNION ALL "
            f"SELECT COALESCE(MAX(served) + 1, 0) FROM {served}",
        ),
    ):
        schema_editor.execute(f"CREATE SEQUENCE IF NOT EXISTS {name} AS bigint MINVALUE 0 START 0")
        schema_editor.execute(f"SELECT setval('{name}', (SELECT MAX(n) FROM ({counted}) AS c(n)), false)")


def drop_sequences(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {ARRIVAL}")
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {SERVE}")


class Migration(migrations.Migration):
    dependencies = [
        ("durable_flow", "0028_hot_table_autovacuum"),
    ]

    operations = [
        migrations.RunPython(create_sequences, drop_sequences),
    ]
