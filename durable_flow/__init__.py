"""durable_flow: durable workflows with flow control, for Django.

    from durable_flow import workflow, step, start

    @step("charge")
    def charge(order): ...

    @workflow("checkout")
    def checkout(ctx, order):
        receipt = ctx.step(charge, order, queue="payments")
        ctx.sleep(timedelta(hours=1))
        return receipt

The API functions import the engine lazily, so this module is safe to import before Django's
app registry is ready (for example from the modules listed in `DURABLE_FLOW["WORKFLOWS"]`).
"""

from durable_flow.definitions.current import NotInStep, StepInfo, current_step
from durable_flow.definitions.registry import step, workflow
from durable_flow.exceptions import (
    ChildFailed,
    ConcurrencyLimitError,
    DurableFlowError,
    InvalidInput,
    InvalidQueueConfig,
    NonDeterminismError,
    RegistrationError,
    RunNotFound,
    SignalTimeout,
    StepFailed,
    StepNotFound,
    WorkflowNotFound,
)
from durable_flow.operations.api import (
    cancel,
    get_run,
    redispatch_pending,
    register_queue,
    send_signal,
    start,
)

__all__ = [
    "ChildFailed",
    "ConcurrencyLimitError",
    "DurableFlowError",
    "InvalidInput",
    "InvalidQueueConfig",
    "NonDeterminismError",
    "NotInStep",
    "RegistrationError",
    "RunNotFound",
    "SignalTimeout",
    "StepFailed",
    "StepInfo",
    "StepNotFound",
    "WorkflowNotFound",
    "cancel",
    "current_step",
    "get_run",
    "redispatch_pending",
    "register_queue",
    "send_signal",
    "start",
    "step",
    "workflow",
]
