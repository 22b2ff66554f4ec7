"""The length of every stored name, id and key, and the form of an admission ticket, written once.

The models use these as their columns' `max_length` (so the migrations hold the same numbers),
and every check of a value bound for one of those columns reads them from here
(`storable_text(run_id, "run_id", RUN_ID_LENGTH)`), so a value that passes the check always
fits. This module imports nothing: queues and workflows are declared and checked by modules that
load before the models may be imported.
"""

from __future__ import annotations

#: A run's id (`WorkflowRun.id`, and every column that points at a run by id).
RUN_ID_LENGTH = 200
#: A workflow's registered name (`WorkflowRun.workflow`).
WORKFLOW_NAME_LENGTH = 200
#: A workflow's version, as text (`WorkflowRun.version`).
VERSION_LENGTH = 50
#: A start quota's key (`WorkflowRun.concurrency_key`).
QUOTA_KEY_LENGTH = 200
#: A step's registered name (`StepCheckpoint.name`).
STEP_NAME_LENGTH = 200
#: A flow-control queue's name (`FlowQueue.name`, `StepCheckpoint.queue`).
QUEUE_NAME_LENGTH = 100
#: A step call's fairness key (`StepCheckpoint.fairness_key`).
FAIRNESS_KEY_LENGTH = 200
#: A signal's name (`Signal.name`).
SIGNAL_NAME_LENGTH = 200
#: An event's name (`Event.name`, a trigger's or a wait's event).
EVENT_NAME_LENGTH = 200
#: An event's id (`Event.id`), its sender's idempotency key.
EVENT_ID_LENGTH = 200
#: Why a worker's adaptive concurrency last changed (`WorkerHeartbeat.last_adjustment_reason`).
ADJUSTMENT_REASON_LENGTH = 300

#: Between a ticket's run id and its step key. Run ids may contain it; step keys never do, so a
#: ticket splits at its last one.
TICKET_SEPARATOR = "/"


def ticket_text(run_id: str, key: str) -> str:
    """The admission ticket of one step call across its retries: `ticket_text("r1", "0") == "r1/0"`."""
    return f"{run_id}{TICKET_SEPARATOR}{key}"
