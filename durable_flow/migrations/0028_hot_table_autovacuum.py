"""Per-table autovacuum settings for the tables every queued workflow leaves dead rows in
(PostgreSQL only; a no-op on SQLite).

PostgreSQL's defaults vacuum a table once its dead rows pass 50 plus a fifth of its live rows:
a queue's task table, a few thousand live rows and hundreds of dead ones a second, would wait for
its own size in dead rows, and the run history's tables for a fifth of the whole history. Here
the small churning tables (tasks, admission slots) are vacuumed from a thousand dead rows at full
speed (no cost delay: they are small), and the growing ones (runs, checkpoints, attempts) from a
thousand plus 2 % of their rows, with a cost limit ten times the default so a pass ends sooner.
These settings act only while autovacuum is on; the poller's own vacuum
(`POLLER["VACUUM_DEAD_ROWS"]`) works either way. No fillfactor: none of these tables' UPDATEs can
be HOT (each sets an indexed column), so free room on a page would stay unused.
"""

from typing import Any

from django.db import migrations

SMALL = {
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_vacuum_cost_delay": "0",
    "autovacuum_analyze_scale_factor": "0.05",
}
GROWING = {
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_vacuum_cost_limit": "2000",
    "autovacuum_vacuum_insert_scale_factor": "0.05",
    "autovacuum_analyze_scale_factor": "0.02",
}
#: Each hot table's storage parameters.
STORAGE_PARAMETERS = {
    "durable_flow_task": SMALL,
    "durable_flow_admissionslot": SMALL,
    "durable_flow_workflowrun": GROWING,
    "durable_flow_stepcheckpoint": GROWING,
    "durable_flow_stepattempt": GROWING,
}


def set_parameters(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, parameters in STORAGE_PARAMETERS.items():
        values = ", ".join(f"{name} = {value}" for name, value in parameters.items())
        schema_editor.execute(f"ALTER TABLE {schema_editor.quote_name(table)} SET ({values})")


def reset_parameters(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, parameters in STORAGE_PARAMETERS.items():
        schema_editor.execute(f"ALTER TABLE {schema_editor.quote_name(table)} RESET ({', '.join(parameters)})")


class Migration(migrations.Migration):
    dependencies = [
        ("durable_flow", "0027_patches"),
    ]

    operations = [
        migrations.RunPython(set_parameters, reset_parameters, elidable=False),
    ]
