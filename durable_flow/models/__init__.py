"""What durable_flow persists, one module per concept: runs and what they record (`runs`), the
`db` transport's task rows (`tasks`), queues and their counters (`queues`), worker heartbeats
(`workers`), the dashboard's history (`history`), the Prometheus counters (`metrics`), debounce and
singleton counters (`start_control`), where each schedule's ticks stand (`schedules`), events and
what they did to runs (`events`), the `db` admission backend's rows (`admission`) and the JSON
API's personal access tokens (`tokens`).

A run's state lives here, never only in memory. Django finds the models through this package,
which names every one of them."""

from durable_flow.models.admission import (
    AdmissionHold,
    AdmissionKeyMark,
    AdmissionKeyServed,
    AdmissionKeyTat,
    AdmissionMark,
    AdmissionResourceHead,
    AdmissionResourceServed,
    AdmissionResourceWaiter,
    AdmissionSlot,
    AdmissionStart,
    AdmissionWaiter,
)
from durable_flow.models.events import START_ACTIONS, Event, EventAction, EventDelivery
from durable_flow.models.history import QueueSample, WorkerSample
from durable_flow.models.metrics import MetricCount
from durable_flow.models.queues import FlowQueue, QueueCounter, QuotaRefusal, StartRefusal
from durable_flow.models.runs import (
    ADMISSION_CAUSES,
    SETTLED_STEP_STATUSES,
    TERMINAL_RUN_STATUSES,
    AttemptStatus,
    BoundedJSONField,
    RunStatus,
    Signal,
    StepAttempt,
    StepCheckpoint,
    StepKind,
    StepStatus,
    WaitCause,
    WorkflowRun,
    new_run_id,
)
from durable_flow.models.schedules import Schedule, ScheduleOutcome
from durable_flow.models.start_control import StartCounter
from durable_flow.models.tasks import Task, TaskKind
from durable_flow.models.tokens import AccessToken
from durable_flow.models.workers import WorkerHeartbeat, dead_worker_cutoff

__all__ = [
    "ADMISSION_CAUSES",
    "SETTLED_STEP_STATUSES",
    "START_ACTIONS",
    "TERMINAL_RUN_STATUSES",
    "AccessToken",
    "AdmissionHold",
    "AdmissionKeyMark",
    "AdmissionKeyServed",
    "AdmissionKeyTat",
    "AdmissionMark",
    "AdmissionResourceHead",
    "AdmissionResourceServed",
    "AdmissionResourceWaiter",
    "AdmissionSlot",
    "AdmissionStart",
    "AdmissionWaiter",
    "AttemptStatus",
    "BoundedJSONField",
    "Event",
    "EventAction",
    "EventDelivery",
    "FlowQueue",
    "MetricCount",
    "QueueCounter",
    "QueueSample",
    "QuotaRefusal",
    "RunStatus",
    "Schedule",
    "ScheduleOutcome",
    "Signal",
    "StartCounter",
    "StartRefusal",
    "StepAttempt",
    "StepCheckpoint",
    "StepKind",
    "StepStatus",
    "Task",
    "TaskKind",
    "WaitCause",
    "WorkerHeartbeat",
    "WorkerSample",
    "WorkflowRun",
    "dead_worker_cutoff",
    "new_run_id",
]
