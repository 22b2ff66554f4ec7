"""`manage.py durable_worker`: run turns and steps from the configured transport (db or rq)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from durable_flow.engine import get_engine
from durable_flow.worker.concurrency import build_controller
from durable_flow.worker.runtime import WorkerRuntime


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
        parser.add_argument("--worker-id", default=None, help="Name this worker (default host:pid:random).")

    def handle(self, *args: Any, **options: Any) -> None:
        engine = get_engine()
        source = engine.transport.source()
        if source is None:
            raise CommandError(
                f"the {engine.transport.name!r} transport runs work in-process; durable_worker serves db and rq"
            )
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
        engine.persist_queues()
        runtime = WorkerRuntime(engine, source, controller, worker_id=options["worker_id"], grace_s=options["grace"])
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
