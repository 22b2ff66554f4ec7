"""`manage.py durable_worker`: run turns and steps from the configured transport."""

from __future__ import annotations

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
            help="A number or 'adaptive'; defaults to TRANSPORT['CONCURRENCY'].",
        )
        parser.add_argument("--burst", action="store_true", help="Exit when no work is left.")
        parser.add_argument("--max-tasks", type=int, default=None, help="Exit after this many tasks.")
        parser.add_argument("--grace", type=float, default=30.0, help="Seconds to finish in-flight tasks on SIGTERM.")
        parser.add_argument("--worker-id", default=None, help="Name this worker (default host:pid:random).")

    def handle(self, *args: Any, **options: Any) -> None:
        engine = get_engine()
        make_source = getattr(engine.transport, "source", None)
        if make_source is None:
            raise CommandError(
                f"the {engine.transport.name!r} transport runs work in-process; durable_worker serves db and rq"
            )
        spec: object = options["concurrency"]
        if spec is None:
            spec = getattr(engine.transport, "concurrency", 1)
        elif isinstance(spec, str) and spec.isdigit():
            spec = int(spec)
        controller = build_controller(spec)
        engine.persist_queues()
        runtime = WorkerRuntime(
            engine, make_source(), controller, worker_id=options["worker_id"], grace_s=options["grace"]
        )
        runtime.install_signal_handlers()
        self.stdout.write(
            f"durable_worker {runtime.worker_id}: transport={engine.transport.name} "
            f"concurrency={controller.mode}:{controller.limit}"
        )
        done = runtime.run(burst=options["burst"], max_tasks=options["max_tasks"])
        self.stdout.write(f"durable_worker {runtime.worker_id}: stopped after {done} task(s)")
