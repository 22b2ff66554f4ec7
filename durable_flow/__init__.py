"""durable_flow: durable workflows with flow control, for Django.

    from durable_flow import workflow, step, start

    @step("charge")
    def charge(order): ...

    @workflow("checkout")
    def checkout(ctx, order):
        receipt = ctx.step(charge, order, queue="payments")
        ctx.sleep(timedelta(hours=1))
        return receipt

This is the one public face: every public function and exception is named here. The
decorators, `current_step` and the exceptions load with the package; the API functions live in
`durable_flow.operations.api`, which imports the engine and the models, and load on first use
(PEP 562), so `import durable_flow` stays safe before Django's app registry is ready (from
`settings.py`, say, or a module listed in `DURABLE_FLOW["WORKFLOWS"]`).
"""

from typing import TYPE_CHECKING

from durable_flow.definitions.current import NotInStep, StepInfo, current_step
from durable_flow.definitions.registry import step, workflow
from durable_flow.exceptions import (
    AdmissionShardError,
    ChildFailed,
    ConcurrencyLimitError,
    DurableFlowError,
    InvalidEvent,
    InvalidInput,
    InvalidQueueConfig,
    InvalidQuota,
    NonDeterminismError,
    QueueNotFound,
    RegistrationError,
    RetryRefused,
    RunNotFound,
    ScheduleNotFound,
    SignalTimeout,
    StartTimeoutError,
    StepFailed,
    StepNotFound,
    TaskNotDeclared,
    UnexpectedSignal,
    UnknownEvent,
    WorkflowNotFound,
)

if TYPE_CHECKING:
    from durable_flow.operations.api import (
        cancel,
        get_run,
        pause_queue,
        pause_schedule,
        redispatch_pending,
        register_queue,
        rerun,
        resume_queue,
        resume_schedule,
        retry,
        send_event,
        send_event_on,
        send_signal,
        start,
        update_queue,
        wait,
    )

__all__ = [
    "AdmissionShardError",
    "ChildFailed",
    "ConcurrencyLimitError",
    "DurableFlowError",
    "InvalidEvent",
    "InvalidInput",
    "InvalidQueueConfig",
    "InvalidQuota",
    "NonDeterminismError",
    "NotInStep",
    "QueueNotFound",
    "RegistrationError",
    "RetryRefused",
    "RunNotFound",
    "ScheduleNotFound",
    "SignalTimeout",
    "StartTimeoutError",
    "StepFailed",
    "StepInfo",
    "StepNotFound",
    "TaskNotDeclared",
    "UnexpectedSignal",
    "UnknownEvent",
    "WorkflowNotFound",
    "cancel",
    "current_step",
    "get_run",
    "pause_queue",
    "pause_schedule",
    "redispatch_pending",
    "register_queue",
    "rerun",
    "resume_queue",
    "resume_schedule",
    "retry",
    "send_event",
    "send_event_on",
    "send_signal",
    "start",
    "step",
    "update_queue",
    "wait",
    "workflow",
]


#: The API functions: the names above not bound yet, loaded from `durable_flow.operations.api`
#: on first use.
API = frozenset(name for name in __all__ if name not in globals())


def __getattr__(name: str) -> object:
    if name in API:
        # Imported on first use, not above: it imports the models, which need the app registry.
        from durable_flow.operations import api

        return getattr(api, name)
    raise AttributeError(f"module 'durable_flow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *API})
