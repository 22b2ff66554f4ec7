"""Shards of the Redis admission backend on Redis Cluster: which hash slot each key lives in.

On Redis Cluster a script may touch the keys of one hash slot only. Every key of the backend
therefore carries a hash tag naming a *shard*, `{P:S}` (P the key prefix, S the shard's name),
and one script call works inside one shard: a queue's slots, waiters, windows and ranking
index, the step-concurrency resources its calls hold, the instance heartbeats that keep those
slots alive and the shard's record of hearing the fleet all live under one tag.

Shards are declared in `DURABLE_FLOW["ADMISSION"]["SHARDS"]`:

    "SHARDS": {
        "llm": {"QUEUES": ["openai", "anthropic"], "WORKFLOWS": ["summarise", "translate"]},
        "mail": {"QUEUES": ["smtp"]},
    }

- a queue lives in the shard that lists it, else in the `default` shard;
- a `fn`-scope step-concurrency resource (`sc:fn:<workflow>...`) lives in its workflow's shard,
  else in `default`; `env`- and `account`-scope resources (shared by several workflows) and any
  other resource name always live in `default`;
- the pseudo-queue of calls gated by step concurrency alone exists once per shard.

A call is decided in one shard, so its queue and every resource it needs must be in the same
one: the steps of a workflow placed in a shard run on that shard's queues (or on no queue), and
a workflow declaring `env` or `account` scope stays in `default` with its queues. A call that
breaks the rule is refused (`AdmissionShardError`); `manage.py check` refuses the declarations it
can see break it (`durable_flow.E030`).
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from durable_flow.definitions.step_concurrency import Constraint
from durable_flow.exceptions import AdmissionShardError

DEFAULT_SHARD = "default"
SHARD_FIELDS = ("QUEUES", "WORKFLOWS")
FN_PREFIX = "sc:fn:"
BRACES = "{}"


def shards_problem(value: Any) -> str | None:
    """What is wrong with a `SHARDS` option, or None: a dict of shard name (no braces) to a dict
    of `QUEUES` and `WORKFLOWS` lists of names, no name in two shards."""
    if not isinstance(value, Mapping):
        return f"must be a dict of shard name to {{'QUEUES': [...], 'WORKFLOWS': [...]}}, got {reprlib.repr(value)}"
    owner: dict[tuple[str, str], str] = {}
    for shard, entry in value.items():
        if not isinstance(shard, str) or not shard or any(c in shard for c in BRACES):
            return f"shard names are non-empty strings without braces, got {shard!r}"
        if not isinstance(entry, Mapping):
            return f"[{shard!r}]: must be a dict with QUEUES and/or WORKFLOWS, got {reprlib.repr(entry)}"
        unknown = sorted(map(str, set(entry) - set(SHARD_FIELDS)))
        if unknown:
            return f"[{shard!r}]: unknown field(s) {', '.join(unknown)} (QUEUES, WORKFLOWS)"
        for kind in SHARD_FIELDS:
            names = entry.get(kind, [])
            if isinstance(names, str) or not isinstance(names, list | tuple):
                return f"[{shard!r}][{kind!r}]: must be a list of names, got {reprlib.repr(names)}"
            for name in names:
                if not isinstance(name, str) or not name:
                    return f"[{shard!r}][{kind!r}]: names are non-empty strings, got {name!r}"
                other = owner.setdefault((kind, name), shard)
                if other != shard:
                    return f"{kind.lower()[:-1]} {name!r} is in two shards, {other!r} and {shard!r}"
    return None


@dataclass(frozen=True)
class ShardMap:
    """Where each queue and resource lives (see the module docstring). Built from a `SHARDS`
    option that `shards_problem` took."""

    queues: Mapping[str, str] = field(default_factory=dict)
    workflows: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_option(cls, raw: Mapping[str, Any] | None) -> ShardMap:
        queues: dict[str, str] = {}
        workflows: dict[str, str] = {}
        for shard, entry in (raw or {}).items():
            queues.update(dict.fromkeys(entry.get("QUEUES", ()), shard))
            workflows.update(dict.fromkeys(entry.get("WORKFLOWS", ()), shard))
        return cls(queues, workflows)

    def names(self) -> list[str]:
        """Every shard, `default` first."""
        declared = set(self.queues.values()) | set(self.workflows.values())
        return [DEFAULT_SHARD, *sorted(declared - {DEFAULT_SHARD})]

    def of_queue(self, queue: str) -> str:
        return self.queues.get(queue, DEFAULT_SHARD)

    def of_workflow(self, workflow: str) -> str:
        return self.workflows.get(workflow, DEFAULT_SHARD)

    def of_resource(self, resource: str) -> str:
        """A `fn`-scope resource's workflow's shard (`sc:fn:<workflow>` or `sc:fn:<workflow>:<key>`;
        a workflow name may hold `:`, the longest declared one wins), else `default`."""
        if not self.workflows or not resource.startswith(FN_PREFIX):
            return DEFAULT_SHARD
        rest = resource[len(FN_PREFIX) :]
        cut = len(rest)
        while cut > 0:
            shard = self.workflows.get(rest[:cut])
            if shard is not None:
                return shard
            cut = rest.rfind(":", 0, cut)
        return DEFAULT_SHARD

    def of_request(self, queue: str, constraints: Sequence[Constraint]) -> str:
        """The one shard a call is decided in: its queue's (or, with no queue, its resources');
        `AdmissionShardError` if its queue and resources are not all in one shard."""
        places = ([(f"queue {queue!r}", self.of_queue(queue))] if queue else []) + [
            (f"resource {c.resource!r}", self.of_resource(c.resource)) for c in constraints
        ]
        if not places:
            return self.of_queue(queue)
        first_what, shard = places[0]
        for what, other in places[1:]:
            if other != shard:
                raise AdmissionShardError(
                    f"{first_what} is in shard {shard!r} but {what} in shard {other!r}: one admission must "
                    'stay in one shard (DURABLE_FLOW["ADMISSION"]["SHARDS"], see docs/redis-cluster.md)'
                )
        return shard


def crossing_workflows(shards: ShardMap, definitions: Iterable[Any]) -> list[str]:
    """The declarations whose keys would cross shards: a workflow placed outside `default` that
    declares `env`- or `account`-scope step concurrency (those resources live in `default`, its
    `fn` ones and its queues in its own shard). One message each."""
    problems = []
    for definition in definitions:
        shard = shards.of_workflow(definition.name)
        shared = sorted({spec.scope for spec in definition.concurrency if spec.scope != "fn"})
        if shard != DEFAULT_SHARD and shared:
            problems.append(
                f"workflow {definition.name!r} is in shard {shard!r} but declares {' and '.join(shared)}-scope "
                f"step concurrency, whose resources are shared by every workflow and live in shard {DEFAULT_SHARD!r}"
            )
    return problems
