"""`manage.py durable_patches`: per `ctx.patched` change, the unfinished runs that may still
need its old branch; exit 1 when `--patch` names a change whose old branch is still needed.

manage.py durable_patches                                   # every change some run reached
manage.py durable_patches --patch double-second             # exit 0 only when it can be removed
manage.py durable_patches --deployed-at 2026-01-01T10:00Z   # a rolling deploy's end
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils.dateparse import parse_datetime

from durable_flow.observe.patches import patch_states


def _aware(text: str) -> datetime:
    when = parse_datetime(text.replace("Z", "+00:00"))
    if when is None or when.tzinfo is None:
        raise CommandError(f"--deployed-at must be an ISO 8601 date and time with a UTC offset, got {text!r}")
    return when


class Command(BaseCommand):
    help = "List, per ctx.patched change, the unfinished runs that may still take its old branch."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--workflow", help="Only this workflow's changes.")
        parser.add_argument("--patch", help="Only this change; exit 1 while its old branch is still needed.")
        parser.add_argument(
            "--deployed-at",
            help="When the last worker running the old code stopped (default: the first run that took the new path).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        deployed_at = _aware(options["deployed_at"]) if options["deployed_at"] else None
        states = patch_states(options["workflow"], options["patch"], deployed_at)
        if not states:
            what = f"change {options['patch']!r}" if options["patch"] else "a ctx.patched change"
            message = f"no run has reached {what} yet: keep its old branch"
            if options["patch"]:
                raise CommandError(message)
            self.stdout.write(message)
            return
        for state in states:
            verdict = "removable" if state.removable else "keep the old branch"
            self.stdout.write(
                f"{state.workflow} {state.patch_id}: {verdict}; new path {state.new_path}, "
                f"old path unfinished {state.old_path}, unfinished without the marker created before "
                f"{state.deployed_at.isoformat()} {state.unmarked}"
                + (f" ({', '.join(state.run_ids)})" if state.run_ids else "")
            )
        if options["patch"] and not all(state.removable for state in states):
            raise CommandError(f"change {options['patch']!r} still has runs that may take its old branch")
