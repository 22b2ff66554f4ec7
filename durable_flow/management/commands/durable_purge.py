"""`manage.py durable_purge`: delete finished runs now, as the poller's retention does over time.

manage.py durable_purge --dry-run                      # what the configured retention would delete now
manage.py durable_purge --older-than 30d               # every finished run finished over 30 days ago
manage.py durable_purge --older-than 12h --workflow checkout --batch-size 200

Without `--older-than` the configured retention applies (`POLLER["RUN_RETENTION_S"]` and each
workflow's `retention`). Runs go in batches, one short transaction each, with a line per batch;
a purge stopped at any point (Ctrl-C, a kill) leaves no orphan rows and is simply run again.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from durable_flow.config.limits import WORKFLOW_NAME_LENGTH
from durable_flow.config.settings import MAX_PURGE_BATCH_SIZE, MAX_RUN_RETENTION_S, get_settings
from durable_flow.config.validation import number_problem, storable_text
from durable_flow.exceptions import InvalidInput
from durable_flow.store import metric_counts
from durable_flow.store.retention import Purged, RetentionPolicy, Scope, dry_run, purge

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_age(text: str) -> timedelta:
    """`30d`, `12h`, `90m`, `3600s` or `3600` (seconds): above 0, at most ten years."""
    match = AGE.match(text)
    seconds = float(match.group(1)) * UNITS[match.group(2) or "s"] if match else None
    problem = number_problem(seconds, minimum=0, maximum=MAX_RUN_RETENTION_S, above_minimum=True, unit="seconds")
    if match is None or problem:
        raise CommandError(
            f"--older-than must be a duration like 30d, 12h, 90m or 3600s, above 0 and at most ten years, got {text!r}"
        )
    return timedelta(seconds=seconds)  # type: ignore[arg-type]  # a float, checked above


class Command(BaseCommand):
    help = "Delete finished runs (with their checkpoints, attempts, signals and events) past their retention."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", default=None, help="Runs finished longer ago than this (30d, 12h...).")
        parser.add_argument("--workflow", default=None, help="Only runs of this workflow.")
        parser.add_argument("--dry-run", action="store_true", help="Count what would go, per table; delete nothing.")
        parser.add_argument("--batch-size", type=int, default=None, help="Runs per transaction (PURGE_BATCH_SIZE).")
        parser.add_argument("--pause-ms", type=int, default=0, help="Sleep between batches, to yield to the workload.")

    def handle(self, *args: Any, **options: Any) -> None:
        settings = get_settings()
        batch_size = settings.purge_batch_size if options["batch_size"] is None else options["batch_size"]
        if problem := number_problem(batch_size, minimum=1, maximum=MAX_PURGE_BATCH_SIZE, integer=True):
            raise CommandError(f"--batch-size {problem}")
        if problem := number_problem(options["pause_ms"], minimum=0, maximum=60_000, integer=True):
            raise CommandError(f"--pause-ms {problem}")
        if options["workflow"] is not None:
            try:
                storable_text(options["workflow"], "--workflow", WORKFLOW_NAME_LENGTH)
            except InvalidInput as exc:
                raise CommandError(str(exc)) from None
        scopes = self._scopes(options, settings)
        if options["dry_run"]:
            counts = dry_run(scopes)
            for table, count in counts.items():
                self.stdout.write(f"{table}: {count}")
            self.stdout.write(f"dry run: {counts['runs']} finished run(s) would be deleted")
            return
        pause = options["pause_ms"] / 1000

        last = [time.monotonic()]

        def after_batch(done: Purged) -> None:
            metric_counts.flush_quietly()  # a purge killed later still counted this batch
            rows = ", ".join(f"{table} {count}" for table, count in sorted(done.rows.items()) if count)
            took = (time.monotonic() - last[0]) * 1000
            self.stdout.write(f"batch: {rows or 'nothing (taken meanwhile)'} ({took:.0f} ms)")
            self.stdout.flush()
            if pause:
                time.sleep(pause)
            last[0] = time.monotonic()

        try:
            total = purge(scopes, batch_size, after_batch=after_batch)
        finally:
            metric_counts.flush_quietly()
        rows = ", ".join(f"{table} {count}" for table, count in sorted(total.rows.items()) if count) or "nothing"
        self.stdout.write(f"deleted {total.runs} finished run(s) in {total.batches} batch(es): {rows}")

    @staticmethod
    def _scopes(options: dict[str, Any], settings: Any) -> list[Scope]:
        now = timezone.now()
        only = None if options["workflow"] is None else frozenset({options["workflow"]})
        if options["older_than"] is not None:
            return [Scope(now - parse_age(options["older_than"]), only=only)]
        policy = RetentionPolicy.configured(settings)
        if not policy.active:
            raise CommandError(
                'no retention is configured (POLLER["RUN_RETENTION_S"] or a workflow\'s retention): pass --older-than'
            )
        scopes = policy.scopes(now)
        if only is None:
            return scopes
        # One workflow: its own retention, or the default one.
        name = options["workflow"]
        if name in policy.by_workflow:
            return [Scope(now - policy.by_workflow[name], only=only)]
        if policy.default is None:
            raise CommandError(f"workflow {name!r} has no retention configured: pass --older-than")
        return [Scope(now - policy.default, only=only)]
