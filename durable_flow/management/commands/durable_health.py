"""`manage.py durable_health`: exit 0 when this process kind is healthy, 1 (with the reason) when not.

manage.py durable_health             # the database answers (a web process's dependency)
manage.py durable_health --worker    # ... and a worker on this host has a live heartbeat
manage.py durable_health --poller    # ... and a poller sampled recently (any host)
"""

from __future__ import annotations

import socket
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from durable_flow.contrib import health
from durable_flow.observe.workers import live_workers_on


class Command(BaseCommand):
    help = "Check the database, and with --worker / --poller that a worker here / a poller is alive."
    # A probe runs every few seconds: the system checks would only slow it down.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--worker", action="store_true", help="A worker on this host has a live heartbeat.")
        parser.add_argument("--poller", action="store_true", help="A poller wrote its samples recently.")
        parser.add_argument(
            "--max-age-s",
            type=float,
            default=None,
            help="With --poller: the oldest acceptable sample (default: 3 x POLLER.SAMPLE_INTERVAL_S).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if (problem := health.database_error()) is not None:
            raise CommandError(problem)
        report = ["database ok"]
        if options["worker"]:
            workers = live_workers_on()
            if not workers:
                raise CommandError(f"no live worker on {socket.gethostname()} (manage.py durable_worker)")
            report.append(f"{len(workers)} live worker(s) here")
        if options["poller"]:
            if (problem := health.poller_error(options["max_age_s"])) is not None:
                raise CommandError(problem)
            report.append("poller ok")
        self.stdout.write(", ".join(report))
