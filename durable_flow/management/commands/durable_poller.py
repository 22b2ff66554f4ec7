"""`manage.py durable_poller`: wake due runs and start due schedule ticks; `--once` drains what
is due and exits."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from durable_flow.config.settings import MAX_POLLER_BATCH_SIZE, MAX_POLLER_INTERVAL_MS
from durable_flow.config.validation import number_problem
from durable_flow.runtime.poller import TimerPoller


class Command(BaseCommand):
    help = "Run the durable timer poller: wakes suspended runs whose wake_at is due."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="Drain what is due now, then exit.")
        parser.add_argument("--interval-ms", type=int, default=None, help="Sleep between ticks (POLLER.INTERVAL_MS).")
        parser.add_argument("--batch-size", type=int, default=None, help="Runs woken per tick (POLLER.BATCH_SIZE).")
        parser.add_argument("--report", default="", help="With --once: write the woken run ids to this JSON file.")

    def handle(self, *args: Any, **options: Any) -> None:
        for flag, key, maximum in (
            ("--interval-ms", "interval_ms", MAX_POLLER_INTERVAL_MS),
            ("--batch-size", "batch_size", MAX_POLLER_BATCH_SIZE),
        ):
            problem = number_problem(options[key], minimum=1, maximum=maximum, integer=True)
            if options[key] is not None and problem:
                raise CommandError(f"{flag} {problem}")
        poller = TimerPoller(batch_size=options["batch_size"], interval_ms=options["interval_ms"])
        if options["once"]:
            woken: list[str] = []
            while batch := poller.tick():
                woken.extend(batch)
            woken.extend(poller.schedules.tick())
            poller.maintain()
            poller.vacuums.wait()  # a vacuum the pass started ends before the process does
            if options["report"]:
                with open(options["report"], "w") as handle:
                    json.dump(woken, handle)
            self.stdout.write(f"woke {len(woken)} run(s)")
            return
        self.stdout.write(f"durable_poller: every {poller.interval_s * 1000:.0f} ms, batch {poller.batch_size}")
        poller.run_forever()
        self.stdout.write("durable_poller: stopped")
