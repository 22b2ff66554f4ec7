"""The busiest keys of each declared step-concurrency constraint, for the admin and the dashboard.

A constraint's resources share a name prefix (`step_concurrency`): `sc:fn:<workflow>:` per key of
one workflow, `sc:env:<environment>:` and `sc:acct:` shared by every workflow that declares the
scope. Constraints that name the same prefix (two workflows sharing an account key, say) are one
row here, listing who declares it at which limit. The counts come from the admission backend
(`AdmissionBackend.constraint_usage`), which holds the slots and the waiting lines, on every
backend.

Each row is in user terms too: the scope in words, and each busy key's value as the workflow's
key expression gave it (the resource name less the constraint's prefix, derived from the
definitions, never parsed back into anything else), with the runs-list filter that selects its
runs (`run_filters`: `key`, `key_scope`, and the workflow for a per-workflow key).
"""

from __future__ import annotations

from typing import Any

from durable_flow.admission.base import AdmissionBackend
from durable_flow.definitions.registry import workflows


def constraint_rows(admission: AdmissionBackend, environment: str, top: int = 10) -> list[dict[str, Any]]:
    """Per declared constraint: its scope, key expression(s), the workflows declaring it with
    their limits, and its `top` busiest keys (`key`, `resource`, `active`, `waiting`)."""
    rows: dict[str, dict[str, Any]] = {}
    for name, definition in sorted(workflows().items()):
        for spec in definition.concurrency:
            prefix, exact = _prefix(name, spec.scope, spec.key is not None, environment)
            row = rows.setdefault(
                prefix,
                {
                    "scope": spec.scope,
                    "scope_label": scope_label(spec.scope, name, environment),
                    "keys": [],
                    "declared_by": [],
                    "prefix": prefix,
                    "exact": exact,
                },
            )
            if spec.describe() not in row["keys"]:
                row["keys"].append(spec.describe())
            row["declared_by"].append({"workflow": name, "limit": spec.limit})
    for row in rows.values():
        # A keyless constraint is one exact name, which longer names may share as a prefix.
        usage = admission.constraint_usage(row["prefix"], limit=1000 if row["exact"] else top)
        row["known"] = usage is not None
        limits = sorted({d["limit"] for d in row["declared_by"]})
        row["limit"] = str(limits[0]) if len(limits) == 1 else f"{limits[0]} to {limits[-1]}"
        row["busiest"] = [
            {
                "key": u.resource[len(row["prefix"]) :] or "(no key)",
                "value": None if row["exact"] else u.resource[len(row["prefix"]) :],
                "resource": u.resource,
                "active": u.active,
                "waiting": u.waiting,
                "filter": runs_filter(row, u.resource[len(row["prefix"]) :]),
            }
            for u in usage or ()
            if not row["exact"] or u.resource == row["prefix"]
        ]
    return list(rows.values())


def scope_label(scope: str, workflow: str, environment: str) -> str:
    """The scope in words: whose steps share one key's slots."""
    if scope == "env":
        return f"every workflow of environment {environment}"
    if scope == "account":
        return "every workflow of every environment"
    return f"workflow {workflow}"


def runs_filter(row: dict[str, Any], value: str) -> dict[str, str]:
    """The runs-list filter (`run_filters.RunFilterForm`'s fields) selecting the runs of one key
    of a constraint row: its value and scope, and the workflow for a per-workflow constraint."""
    params = {"key_scope": row["scope"], "key": value}
    if row["scope"] == "fn":
        params["workflow"] = row["declared_by"][0]["workflow"]
    return params


def _prefix(workflow: str, scope: str, keyed: bool, environment: str) -> tuple[str, bool]:
    """The resource-name prefix of a constraint, and whether it is one exact name (no key)."""
    if scope == "env":
        return f"sc:env:{environment}:", False
    if scope == "account":
        return "sc:acct:", False
    return (f"sc:fn:{workflow}:", False) if keyed else (f"sc:fn:{workflow}", True)
