"""The Prometheus counters and histograms every process adds to (`durable_flow.store.metric_counts`):
one row per process, metric and label set, so no two processes ever write the same row."""

from __future__ import annotations

from django.db import models


class MetricCount(models.Model):
    """What one process has counted of one series, ever: a counter's total, or one piece of a
    histogram (a bucket's own count, not cumulative; the sum; the count). A metric's figure is
    the sum over every process's row. Rows of processes silent for a long time are folded into
    the `process="retired"` row of their series, so the table stays small and totals never drop."""

    process = models.CharField(max_length=200, help_text="The process that counted: a worker's id, or host:pid.")
    metric = models.CharField(max_length=100, help_text="The sample name: `..._total`, `..._bucket`, `..._sum`...")
    labels = models.TextField(help_text="The series' labels as canonical JSON (sorted pairs).")
    value = models.FloatField(default=0.0)
    updated_at = models.DateTimeField(help_text="The process's last flush into this row.")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["process", "metric", "labels"], name="df_metric_count_series"),
        ]
        indexes = [models.Index(fields=["updated_at"], name="df_metric_count_updated")]

    def __str__(self) -> str:
        return f"{self.process} {self.metric}{self.labels}"
