"""Per-key step concurrency: `@workflow(..., concurrency=...)` caps the step attempts executing at once.

A declaration is parsed once, at registration, into at most two `ConcurrencySpec`s. When a run
starts, each key is evaluated over the run's `input` (CEL variables `input`, `run_id`,
`workflow`) and the run stores the result as constraints on `WorkflowRun.step_concurrency`:
`[{"resource": "sc:fn:<workflow>:<key>", "limit": 2}, ...]`. Every step of the run asks
admission with those constraints, so queued work keeps the key it was given when its run
started (a changed expression affects new runs only).

Resource names by scope:

- `fn`      `sc:fn:<workflow>:<key>` (no key: `sc:fn:<workflow>`): this workflow's steps only;
- `env`     `sc:env:<environment>:<key>`: every workflow of `DURABLE_FLOW["ENVIRONMENT"]`;
- `account` `sc:acct:<key>`: every environment sharing the admission backend.

Each run checks a shared resource's active count against its own `limit`.

CEL: `durable_flow.definitions.cel`, the one evaluator of every key the project takes (quota,
debounce, singleton and these); a key is evaluated once per run start, never per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from durable_flow.config.validation import MAX_COUNT, number_problem
from durable_flow.definitions.keys import Key, describe_key, evaluate_key, parse_key
from durable_flow.exceptions import RegistrationError

Scope = Literal["fn", "env", "account"]
SCOPES: tuple[Scope, ...] = ("fn", "env", "account")
MAX_CONSTRAINTS = 2


@dataclass(frozen=True, slots=True)
class Constraint:
    """A step-concurrency gate: the call may start only while fewer than `limit` slots of
    `resource` are held (each call checks the shared count against its own limit)."""

    resource: str
    limit: int


@dataclass(frozen=True)
class ConcurrencySpec:
    """One parsed constraint of a workflow: `limit` steps executing per evaluated key and scope."""

    limit: int
    scope: Scope = "fn"
    key: Key | None = None

    def describe(self) -> str:
        """The key as written (for errors and the admin)."""
        return "(no key)" if self.key is None else describe_key(self.key)

    def resource(self, workflow: str, environment: str, input: Any, run_id: str) -> str:
        """The resource this constraint names for one run; `InvalidInput` if the key is not a string."""
        if self.key is None:
            return f"sc:fn:{workflow}"
        value = evaluate_key(self.key, f"workflow {workflow!r}: concurrency", input, run_id, workflow)
        if self.scope == "fn":
            return f"sc:fn:{workflow}:{value}"
        if self.scope == "env":
            return f"sc:env:{environment}:{value}"
        return f"sc:acct:{value}"


def parse_concurrency(workflow: str, value: object) -> tuple[ConcurrencySpec, ...]:
    """Parse `@workflow(..., concurrency=...)`: an int, a dict, or a list of at most two dicts.
    A limit of 0 (or none) means no constraint. Errors are `RegistrationError`s naming the workflow."""
    if value is None:
        return ()
    entries: Sequence[object]
    if isinstance(value, int | Mapping):
        entries = [value]
    elif isinstance(value, list | tuple):
        entries = value
    else:
        raise RegistrationError(
            f"workflow {workflow!r}: concurrency must be an int, a dict or a list of dicts, got {type(value).__name__}"
        )
    if len(entries) > MAX_CONSTRAINTS:
        raise RegistrationError(
            f"workflow {workflow!r}: at most {MAX_CONSTRAINTS} concurrency constraints, got {len(entries)}"
        )
    specs = [spec for entry in entries if (spec := _parse_one(workflow, entry)) is not None]
    return tuple(specs)


def _parse_one(workflow: str, entry: object) -> ConcurrencySpec | None:
    where = f"workflow {workflow!r}: concurrency"
    if isinstance(entry, int | float):  # a bare limit (a bool or a float is then refused as one)
        entry = {"limit": entry}
    if not isinstance(entry, Mapping):
        raise RegistrationError(f"{where} entries must be dicts, got {type(entry).__name__}")
    unknown = sorted(set(map(str, entry)) - {"limit", "key", "scope"})
    if unknown:
        raise RegistrationError(f"{where}: unknown field(s) {', '.join(unknown)}")
    limit = entry.get("limit", 0)
    problem = number_problem(limit, minimum=0, maximum=MAX_COUNT, integer=True)
    if problem:
        raise RegistrationError(f"{where} limit {problem}")
    scope = entry.get("scope", "fn")
    if scope not in SCOPES:
        raise RegistrationError(f"{where} scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    raw_key = entry.get("key")
    key = None if raw_key is None else parse_key(where, raw_key)
    if scope != "fn" and key is None:
        raise RegistrationError(f"{where}: scope {scope!r} requires a key")
    if limit == 0:
        return None
    return ConcurrencySpec(limit=limit, scope=scope, key=key)


def evaluate(
    workflow: str, specs: Sequence[ConcurrencySpec], input: Any, run_id: str, environment: str
) -> list[dict[str, Any]]:
    """The constraints one run stores: `[{"resource": ..., "limit": ...}]`. Raises `InvalidInput`
    (before anything is created) when a key does not evaluate to a string."""
    constraints: list[dict[str, Any]] = []
    seen: set[str] = set()
    for spec in specs:
        resource = spec.resource(workflow, environment, input, run_id)
        if resource in seen:
            # Two constraints that name the same resource: the lower limit is the binding one.
            constraints = [
                {"resource": c["resource"], "limit": min(c["limit"], spec.limit)} if c["resource"] == resource else c
                for c in constraints
            ]
            continue
        seen.add(resource)
        constraints.append({"resource": resource, "limit": spec.limit})
    return constraints


def constraints_of(stored: Sequence[Mapping[str, Any]] | None) -> tuple[Constraint, ...]:
    """The admission constraints a run stored at its start (`WorkflowRun.step_concurrency`)."""
    return tuple(Constraint(str(c["resource"]), int(c["limit"])) for c in stored or ())


def plan_run(definition: Any, input: Any, run_id: str, environment: str, admission: Any) -> list[dict[str, Any]]:
    """The constraints a new run of `definition` stores, checked before anything is created:
    `InvalidInput` for a key that is not a string, `ImproperlyConfigured` (naming the setting)
    when the admission backend cannot enforce them."""
    if not definition.concurrency:
        return []
    if not getattr(admission, "SUPPORTS_CONSTRAINTS", False):
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(
            f'workflow {definition.name!r} declares step concurrency, which DURABLE_FLOW["ADMISSION"] '
            f"({type(admission).__name__}) cannot enforce: use the 'local', 'db' or 'redis' admission backend"
        )
    return evaluate(definition.name, definition.concurrency, input, run_id, environment)
