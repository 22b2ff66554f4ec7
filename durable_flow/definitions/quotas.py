"""Start quotas: at most `limit` runs of a key in flight; the next start is refused at once.

A quota is not a mutex and not a queue: a start over the limit raises `ConcurrencyLimitError`
(an HTTP 429) and creates nothing. The database is the only source of truth: a run carries its
key in `WorkflowRun.concurrency_key` (and the tag `concurrency:<key>`), and the check is one
indexed `COUNT(*)` of the key's runs in the counted statuses, so nothing leaks when a process
dies: a slot frees the moment its run leaves those statuses.

Unlike the reference's soft cap (count, then insert), the count and the INSERT are serialised
per key, so starts racing for the last slot cannot overshoot:

- PostgreSQL: `pg_advisory_xact_lock(hashtextextended(key, 0))` in the start's transaction.
  Different keys take different locks (a 64-bit hash collision only serialises two keys, it
  never miscounts: the COUNT filters on the key itself).
- SQLite: durable_flow's `transaction_mode = IMMEDIATE` already takes the database's write lock
  when the transaction opens, so every start is serialised.
- Other vendors: the start's transaction is the only guard (the reference's soft cap).

This module holds the declaration (`QuotaSpec`) and a start's plan (`plan`, `QuotaCheck`); the
key's lock, the count and the check a start passes are `durable_flow.store.quotas`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from asgiref.sync import async_to_sync

from durable_flow.config.limits import QUOTA_KEY_LENGTH
from durable_flow.config.validation import MAX_COUNT, number_problem, storable_text
from durable_flow.definitions.cel import CelProgram, compile_cel, evaluate_cel
from durable_flow.definitions.serialization import error_info
from durable_flow.exceptions import ConcurrencyLimitError, InvalidInput, InvalidQuota, RegistrationError

# Literal status names rather than `RunStatus`: `@workflow` parses quotas at import time, before
# Django's app registry is ready, so this module must not import the models at the top.
#: Every non-terminal status occupies a slot unless the quota narrows it.
ACTIVE_STATUSES: tuple[str, ...] = ("debounced", "pending", "running", "suspended", "cancelling")
RUN_STATUSES: tuple[str, ...] = (*ACTIVE_STATUSES, "cancelled", "completed", "failed")
TAG_PREFIX = "concurrency:"
#: Marks a child checkpoint whose start was refused, so a replay raises the same error.
REFUSED = "quota_refused"

KeyFn = Callable[[Any], "str | None"]
LimitFn = Callable[[str], Any]


@dataclass(frozen=True)
class QuotaSpec:
    """A parsed quota: `key` (a callable of the input, or a literal key), `limit` (an int, or a
    sync or async callable of the key) and the run statuses that occupy a slot."""

    key: KeyFn | str
    limit: int | LimitFn
    count_statuses: tuple[str, ...] = ACTIVE_STATUSES

    @classmethod
    def build(cls, value: QuotaSpec | Mapping[str, Any], *, per_start: bool) -> QuotaSpec:
        """Parse and validate a quota once; `InvalidQuota` names the bad field.

        A string key is literal on a per-start quota; on a workflow it is a CEL expression over
        `input` (compiled here, so a syntax error fails registration).
        """
        if isinstance(value, QuotaSpec):
            return value
        if not isinstance(value, Mapping):
            raise InvalidQuota(f"a quota must be a mapping with 'key' and 'limit', got {type(value).__name__}")
        unknown = set(value) - {"key", "limit", "count_statuses"}
        if unknown:
            raise InvalidQuota(f"unknown quota field(s): {', '.join(sorted(map(str, unknown)))}")
        if "key" not in value or "limit" not in value:
            raise InvalidQuota("a quota needs both 'key' and 'limit'")
        key = value["key"]
        if isinstance(key, str):
            key = check_key(key) if per_start else CelKey.compile(key)
        elif not callable(key):
            raise InvalidQuota(f"quota key must be a string or a callable of the input, got {type(key).__name__}")
        limit = value["limit"]
        if not callable(limit):
            # A workflow's limit may be 0 (a plan with none: every start refused); a per-start
            # limit is the caller's own number for this start, so 0 there is a mistake.
            check_limit(limit, minimum=1 if per_start else 0)
        statuses = value.get("count_statuses", ACTIVE_STATUSES)
        if isinstance(statuses, str) or not isinstance(statuses, Iterable):
            raise InvalidQuota("quota count_statuses must be a list of run statuses")
        statuses = tuple(str(status) for status in statuses)
        bad = [status for status in statuses if status not in RUN_STATUSES]
        if bad or not statuses:
            raise InvalidQuota(f"quota count_statuses must name run statuses from {RUN_STATUSES}, got {bad or '[]'}")
        return cls(key=key, limit=limit, count_statuses=statuses)

    def resolve_key(self, input: Any) -> str | None:
        """The bucket for this input; None leaves the start unlimited. A key callable that
        raises on the input is an `InvalidQuota` (its error chained), like a failing CEL key."""
        if isinstance(self.key, str):
            return self.key
        try:
            key = self.key(input)
        except InvalidQuota:
            raise
        except Exception as exc:
            raise InvalidQuota(f"quota key {_name(self.key)} failed on this input: {exc!r}") from exc
        return None if key is None else check_key(key)

    def resolve_limit(self, key: str) -> int:
        """The limit for `key`; an async callable is run to completion with `async_to_sync`."""
        if not callable(self.limit):
            return self.limit
        if inspect.iscoroutinefunction(self.limit):
            value = async_to_sync(self.limit)(key)
        else:
            value = self.limit(key)
            if inspect.isawaitable(value):
                value = async_to_sync(_awaited)(value)
        return check_limit(value)


@dataclass(frozen=True)
class CelKey:
    """A workflow's quota key as a CEL expression over the start's `input` (or `event`, the same
    value: a triggered run's input is its event), e.g.
    `"tenant:" + input.tenant_id`, or `has(input.tenant_id) ? "tenant:" + input.tenant_id : null`
    (null leaves the start unlimited). Compiled once, at registration."""

    expression: str
    program: CelProgram

    @classmethod
    def compile(cls, expression: str) -> CelKey:
        try:
            program = compile_cel(expression)
        except ValueError as exc:
            raise InvalidQuota(f"quota key {exc}") from None
        return cls(expression=expression, program=program)

    def __call__(self, input: Any) -> str | None:
        try:
            value = evaluate_cel(self.program, input=input, event=input)  # `event`: a triggered run's input
        except LookupError as exc:
            raise InvalidQuota(f"quota key {self.expression!r} failed on this input: {exc.args[0]}") from None
        if value is None:
            return None
        if not isinstance(value, str):
            raise InvalidQuota(f"quota key {self.expression!r} must give a string or null, got {value!r}")
        return str(value)


async def _awaited(value: Any) -> Any:
    return await value


def _name(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def check_key(key: object) -> str:
    """`key` if the run's `concurrency_key` column can store it; else `InvalidQuota`."""
    longest = QUOTA_KEY_LENGTH
    try:
        return storable_text(key, "a quota key", longest)
    except InvalidInput as exc:
        raise InvalidQuota(str(exc)) from None


def check_limit(limit: object, minimum: int = 0) -> int:
    """`limit` if it is an int from `minimum` to what `concurrency_limit` (an `integer`) holds."""
    problem = number_problem(limit, minimum=minimum, maximum=MAX_COUNT, integer=True)
    if problem:
        raise InvalidQuota(f"quota limit {problem} (or a callable of the key)")
    return limit  # type: ignore[return-value]  # an int, checked above


def parse_workflow_quota(name: str, value: QuotaSpec | Mapping[str, Any] | None) -> QuotaSpec | None:
    """Parse `@workflow(..., quota=...)`; a bad quota is a `RegistrationError` naming the workflow."""
    if value is None:
        return None
    try:
        return QuotaSpec.build(value, per_start=False)
    except InvalidQuota as exc:
        raise RegistrationError(f"workflow {name!r}: {exc}") from None


@dataclass(frozen=True)
class QuotaCheck:
    """What a start must verify inside its transaction: `limit` runs of `key` at most."""

    key: str
    limit: int
    count_statuses: tuple[str, ...]
    workflow: str

    @property
    def tag(self) -> str:
        return f"{TAG_PREFIX}{self.key}"


def plan(
    workflow: str, workflow_quota: QuotaSpec | None, quota: QuotaSpec | Mapping[str, Any] | None, input: Any
) -> QuotaCheck | None:
    """The check a start needs (a per-start `quota` overrides the workflow's), or None when the
    start is unlimited. Runs the key and limit callables, before the transaction opens, so a
    slow per-plan lookup does not hold the key's lock."""
    spec = QuotaSpec.build(quota, per_start=True) if quota is not None else workflow_quota
    if spec is None:
        return None
    key = spec.resolve_key(input)
    if key is None:
        return None
    return QuotaCheck(key=key, limit=spec.resolve_limit(key), count_statuses=spec.count_statuses, workflow=workflow)


def run_fields(check: QuotaCheck | None, tags: list[str]) -> dict[str, Any]:
    """The run's quota columns: its key and the `concurrency:<key>` tag."""
    if check is None:
        return {"tags": tags}
    return {"concurrency_key": check.key, "concurrency_limit": check.limit, "tags": [*tags, check.tag]}


def refusal_error(exc: ConcurrencyLimitError) -> dict[str, Any]:
    """What a refused child's checkpoint records, so a replay raises the same error."""
    return {
        "status": REFUSED,
        "error": error_info(exc),
        "quota": {"key": exc.key, "limit": exc.limit, "active": exc.active, "workflow": exc.workflow},
    }
