"""`manage.py durable_worker`: run turns and steps from the configured transport (db or rq)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from durable_flow.engine import get_engine
from durable_flow.runtime.controllers import build_controller
from durable_flow.runtime.heartbeat import WorkerNameTaken, claim_worker_id
from durable_flow.runtime.worker import WorkerRuntime
from durable_flow.store.outage import Outage, transient_errors

logger = logging.getLogger("durable_flow.worker")


def _exit_on_startup_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM/SIGINT before the worker loop runs: say so, then exit as the signal would have.

    Without this a worker stopped while it builds its engine (a supervisor's restart racing a
    slow start) vanishes with -15 and no line in its log.
    """
    name = signal.Signals(signum).name
    logger.warning("durable_worker pid %d: received %s during start-up; exiting", os.getpid(), name)
    sys.stderr.flush()
    raise SystemExit(128 + signum)


def log_startup_signals() -> None:
    """Install `_exit_on_startup_signal` until the runtime installs its graceful handlers."""
    signal.signal(signal.SIGTERM, _exit_on_startup_signal)
    signal.signal(signal.SIGINT, _exit_on_startup_signal)


class Command(BaseCommand):
    help = "Run a durable_flow worker for the configured transport (db or rq)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--concurrency",
            default=None,
            help='A number, \'adaptive\', or an adaptive spec as JSON (\'{"mode": "adaptive", "max": 16}\'); '
            "defaults to TRANSPORT['CONCURRENCY'].",
        )
        parser.add_argument("--burst", action="store_true", help="Exit when no work is left.")
        parser.add_argument("--max-tasks", type=int, default=None, help="Exit after this many tasks.")
        parser.add_argument("--grace", type=float, default=30.0, help="Seconds to finish in-flight tasks on SIGTERM.")
        parser.add_argument(
            "--lane",
            action="append",
            default=None,
            help="rq only: serve this RQ_QUEUES entry's jobs (QUEUE, or one TRANSPORT['ROUTES'] names); repeat "
            "for several. Default: every lane, on every Redis they are on.",
        )
        parser.add_argument(
            "--name",
            default=None,
            help="This worker's name, its id being host:NAME, kept across restarts (default: the lowest "
            "free w0, w1, ... on this host).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        log_startup_signals()
        engine = get_engine()
        lanes = options["lane"]
        if lanes and engine.transport.name != "rq":
            raise CommandError(f"--lane: the {engine.transport.name!r} transport has no lanes (rq has)")
        try:
            source = engine.transport.source(lanes=lanes) if lanes else engine.transport.source()
        except ImproperlyConfigured as exc:
            raise CommandError(f"--lane: {exc}") from exc
        if source is None:
            raise CommandError(
                f"the {engine.transport.name!r} transport runs work in-process; durable_worker serves db and rq"
            )
        name = options["name"]
        if name is not None and (not name.strip() or len(name) > 100 or any(c.isspace() for c in name)):
            raise CommandError("--name: 1 to 100 characters, no spaces")
        spec: object = options["concurrency"]
        setting = "--concurrency"
        if spec is None:
            spec = engine.transport.concurrency
            setting = 'DURABLE_FLOW["TRANSPORT"]["CONCURRENCY"]'
        elif isinstance(spec, str) and spec.isdigit():
            spec = int(spec)
        elif isinstance(spec, str) and spec.lstrip().startswith("{"):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                raise CommandError(f"--concurrency: invalid JSON: {exc}") from exc
        controller = build_controller(spec, setting=setting)
        settings = engine.settings
        outage = Outage("durable_worker start-up", logger)
        while True:  # the database may be down (or drop us) while the worker starts: wait for it
            try:
                engine.persist_queues()
                worker_id = claim_worker_id(
                    name, engine.transport.name, settings.heartbeat_ttl_s, settings.heartbeat_interval_s
                )
            except WorkerNameTaken as exc:
                raise CommandError(str(exc)) from exc
            except transient_errors() as exc:
                from django.db import close_old_connections

                close_old_connections()
                time.sleep(outage.failed(exc))
                continue
            outage.recovered()
            break
        try:
            # Jobs a crashed earlier process of this name had claimed: claimable now, not when
            # their leases lapse (it is dead by the poller's own rule, or the name was not free).
            engine.transport.reclaim_from([worker_id])
        except transient_errors():
            logger.warning("could not reclaim the jobs of %s's earlier process; their leases lapse", worker_id)
        runtime = WorkerRuntime(engine, source, controller, worker_id=worker_id, grace_s=options["grace"])
        runtime.install_signal_handlers()
        self.stdout.write(
            f"durable_worker {runtime.worker_id}: transport={engine.transport.name} "
            f"queues={','.join(runtime.source.queues)} concurrency={controller.mode}:{controller.limit}"
        )
        done = runtime.run(burst=options["burst"], max_tasks=options["max_tasks"])
        self.stdout.write(f"durable_worker {runtime.worker_id}: stopped after {done} task(s)")
        if runtime.abandoned:
            # Handed-back tasks still occupy their threads, which the interpreter would join at
            # exit; their work is requeued, so leave without waiting for them.
            self.stdout.write(f"durable_worker {runtime.worker_id}: handed back {runtime.abandoned} task(s)")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
