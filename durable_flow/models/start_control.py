"""What debounce and singleton (`durable_flow.definitions.start_control`) persist beyond the run's
own columns: the count of starts they turned away, per workflow and outcome."""

from __future__ import annotations

from django.db import models


class StartCounter(models.Model):
    """Starts that debounce or singleton turned away from creating a run, per workflow and
    outcome (`debounced`, `skipped`, `replaced`), ever: shared by every process for Prometheus
    and the dashboard, advanced like `QueueCounter` (`durable_flow.store.counters`)."""

    workflow = models.CharField(max_length=200)
    outcome = models.CharField(max_length=20)
    starts = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["workflow", "outcome"]
        constraints = [models.UniqueConstraint(fields=["workflow", "outcome"], name="df_start_counter_outcome")]

    def __str__(self) -> str:
        return f"{self.workflow} {self.outcome}"
