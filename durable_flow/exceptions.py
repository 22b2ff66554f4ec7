"""The typed errors of durable_flow's public API."""

from __future__ import annotations

from datetime import datetime

from django.core.exceptions import SuspiciousOperation


class DurableFlowError(Exception):
    """Base class of every error durable_flow raises on purpose."""


class WorkflowNotFound(DurableFlowError, LookupError):
    """No workflow is registered under that name."""


class StepNotFound(DurableFlowError, LookupError):
    """No step is registered under that name (a task names a step this process does not know)."""


class TaskNotDeclared(DurableFlowError, SuspiciousOperation):
    """A task run names something that is no declared `@task` (stored input, never imported)."""

    def __init__(self, path: object) -> None:
        self.path = path
        super().__init__(
            f"{path!r} is not a declared task: a task run calls only a @task of a DurableFlowBackend, "
            "declared in an installed app's tasks module or a module listed in DURABLE_FLOW['WORKFLOWS']; "
            "nothing was imported for it"
        )


class RegistrationError(DurableFlowError):
    """A workflow or step was declared twice, or declared wrongly."""


class RunNotFound(DurableFlowError, LookupError):
    """No run has that id."""


class InvalidInput(DurableFlowError, ValueError):
    """Input or output that cannot be stored: not JSON, or too large."""


class InvalidEvent(InvalidInput):
    """An event that cannot be recorded: a malformed name or id, or data that is not a JSON
    object within `MAX_PAYLOAD_BYTES`; the message names what is wrong."""


class UnknownEvent(DurableFlowError, LookupError):
    """The event name is not declared in `DURABLE_FLOW["EVENTS"]` (a misspelt name would
    otherwise be sent, and waited for, in vain)."""


class ScheduleNotFound(DurableFlowError, LookupError):
    """No schedule is stored for that workflow (it declares none, or no poller has run since)."""


class QueueNotFound(DurableFlowError, LookupError):
    """No queue has that name."""


class InvalidQueueConfig(DurableFlowError, ValueError):
    """A queue's configuration is invalid; the message names the field."""


class InvalidStartTimeout(InvalidQueueConfig):
    """A queue's `start_timeout_s` or `on_start_timeout` is wrong (`manage.py check`: E016)."""


class InvalidQuota(DurableFlowError, ValueError):
    """A start quota is malformed (or its key/limit callable returned a bad value)."""


class NonDeterminismError(DurableFlowError):
    """The workflow's code no longer matches the history recorded for a running run."""


class StepFailed(DurableFlowError):
    """A step exhausted its retries; raised inside the workflow at the `ctx.step` call.

    The workflow may catch it; if it does not, the run fails with this error.
    """

    def __init__(self, step: str, error: dict[str, object]) -> None:
        self.step = step
        self.error = error
        super().__init__(f"step {step!r} failed: {error.get('type')}: {error.get('message')}")


class StartTimeoutError(StepFailed, TimeoutError):
    """A step call waited for admission longer than its `start_timeout` and gave up, never run;
    raised inside the workflow at the `ctx.step` call (`on_start_timeout="fail"`, the default).

    A `StepFailed`, so a workflow that catches step failures catches it too, and a fan fails
    with it as with any failed step. `.queue`, `.waited_s` (seconds in line), `.timeout_s` (the
    limit), `.held_by` (what was full, in words: "its cap of 2 was full")."""

    def __init__(self, step: str, error: dict[str, object]) -> None:
        self.queue = str(error.get("queue") or "")
        self.waited_s = _seconds(error.get("waited_s"))
        self.timeout_s = _seconds(error.get("timeout_s"))
        self.held_by = str(error.get("held_by") or "")
        self.step = step
        self.error = error
        DurableFlowError.__init__(self, str(error.get("message") or f"step {step!r} gave up waiting for admission"))


def _seconds(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


class ChildFailed(DurableFlowError):
    """A child run ended failed or cancelled; raised inside the parent at `ctx.child`."""

    def __init__(self, run_id: str, status: str, error: object) -> None:
        self.run_id = run_id
        self.status = status
        self.error = error
        super().__init__(f"child run {run_id!r} ended {status}: {error}")


class SignalTimeout(DurableFlowError, TimeoutError):
    """`ctx.wait_for_signal(..., timeout=...)` ran out before the signal arrived."""


class ConcurrencyLimitError(DurableFlowError):
    """A start was refused at once because its quota is full (mapped to HTTP 429).

    `retry_at` is when a slot frees as planned now (a run holding one is parked until a known
    time and leaves the counted statuses then), or None when no holder has a known end: a
    running run's end is not known."""

    def __init__(self, key: str, limit: int, active: int, workflow: str, *, retry_at: datetime | None = None) -> None:
        self.key = key
        self.limit = limit
        self.active = active
        self.workflow = workflow
        self.retry_at = retry_at
        super().__init__(f"quota {key!r} is full for {workflow!r}: {active} active, limit {limit}")


class UnexpectedSignal(DurableFlowError):
    """`send_signal(..., confirm=False)`: the run does not wait for a signal of that name now.
    Sent anyway (`confirm=True`), it is kept until the run waits for it, so a misspelt name
    would sit there unnoticed. `.name`, `.awaited` (the names the run waits for)."""

    def __init__(self, run_id: str, name: str, awaited: list[str]) -> None:
        self.name, self.awaited = name, awaited
        waits = ", ".join(repr(n) for n in awaited) if awaited else "no signal"
        super().__init__(f"run {run_id!r} does not wait for signal {name!r} (it waits for {waits})")


class RetryRefused(DurableFlowError):
    """The run cannot be retried (not failed/cancelled, its workflow's version changed, or its
    parent has finished); the message says which."""


class AdmissionShardError(DurableFlowError, ValueError):
    """On Redis Cluster, one admission would span two shards: its queue and a step-concurrency
    resource it needs are declared in different ones (`DURABLE_FLOW["ADMISSION"]["SHARDS"]`)."""
