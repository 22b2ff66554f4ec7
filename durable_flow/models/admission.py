"""The `db` admission backend's rows: held slots, waiters, window marks, fairness counters and
step-concurrency holds. Part of the `durable_flow` app (re-exported by `durable_flow.models`)."""

from __future__ import annotations

from django.db import models


class AdmissionSlot(models.Model):
    """A slot held in a queue by a ticket (`run_id/step_key`) from admission until its result lands."""

    queue = models.CharField(max_length=100)
    ticket = models.CharField(max_length=320)
    acquired_ms = models.BigIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["queue", "ticket"], name="df_slot_queue_ticket")]


class AdmissionWaiter(models.Model):
    """A blocked call waiting its turn; ranked by priority, key last served, then arrival."""

    queue = models.CharField(max_length=100)
    ticket = models.CharField(max_length=320)
    priority = models.IntegerField(default=0)
    fairness_key = models.CharField(max_length=200)
    key_served = models.BigIntegerField(default=-1, help_text="When its fairness key was last served (serve counter).")
    arrival = models.BigIntegerField()
    seen_ms = models.BigIntegerField()
    constrained = models.BooleanField(default=False, help_text="Whether step-concurrency constraints gate it too.")
    constraints = models.JSONField(default=list, blank=True, help_text="[[resource, limit], ...]")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["queue", "ticket"], name="df_waiter_queue_ticket")]
        indexes = [
            models.Index(fields=["queue", "-priority", "key_served", "arrival"], name="df_waiter_rank"),
            models.Index(fields=["queue", "fairness_key"], name="df_waiter_key"),
        ]


class AdmissionMark(models.Model):
    """One admission's (grant's) timestamp: paces grants to the rate limit (pruned once older
    than the period)."""

    queue = models.CharField(max_length=100)
    at_ms = models.BigIntegerField()

    class Meta:
        indexes = [models.Index(fields=["queue", "at_ms"], name="df_mark_queue_at")]


class AdmissionStart(models.Model):
    """One step start's timestamp: what a queue's rate limit promises the provider (pruned once
    older than the period)."""

    queue = models.CharField(max_length=100)
    at_ms = models.BigIntegerField()

    class Meta:
        indexes = [models.Index(fields=["queue", "at_ms"], name="df_start_queue_at")]


class AdmissionKeyServed(models.Model):
    """When a fairness key was last served in a queue, and the queue's counters."""

    queue = models.CharField(max_length=100)
    fairness_key = models.CharField(max_length=200)
    served = models.BigIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["queue", "fairness_key"], name="df_served_queue_key")]


class AdmissionHold(models.Model):
    """A step-concurrency slot: `ticket` holds one slot of `resource` from admission until its
    result lands (a resource's active count is its number of rows)."""

    resource = models.CharField(max_length=320)
    ticket = models.CharField(max_length=320)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["resource", "ticket"], name="df_hold_resource_ticket")]
        indexes = [models.Index(fields=["ticket"], name="df_hold_ticket")]


class AdmissionResourceWaiter(models.Model):
    """A parked call indexed under a resource it needs, so a freed slot of that resource finds
    its waiters across queues: the first ones by priority, then arrival (the id), ranked among
    themselves by the last serve of their *other* key (least recently served first: one
    account's backlog on a shared ceiling cannot starve the others)."""

    resource = models.CharField(max_length=320)
    ticket = models.CharField(max_length=320)
    queue = models.CharField(max_length=100, blank=True)
    priority = models.IntegerField(default=0)
    limit = models.IntegerField()
    other = models.CharField(
        max_length=320, blank=True, default="", help_text="Its other resource; empty when it needs this one alone."
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["resource", "ticket"], name="df_rwaiter_resource_ticket")]
        indexes = [
            models.Index(fields=["resource", "other", "-priority", "id"], name="df_rwaiter_key"),
            models.Index(fields=["ticket"], name="df_rwaiter_ticket"),
            models.Index(fields=["resource", "limit"], name="df_rwaiter_limit"),
        ]


class AdmissionResourceHead(models.Model):
    """The head of one key's waiters of a resource (its first `AdmissionResourceWaiter` by
    priority, then arrival), ranked by priority, then the key's last serve, then arrival: a freed
    resource reads its keys' heads best first, not its whole line. Kept current on join, leave
    and serve (`durable_flow.admission.db.heads`)."""

    resource = models.CharField(max_length=320)
    other = models.CharField(max_length=320, blank=True, default="", help_text="The key; empty: needs it alone.")
    priority = models.IntegerField()
    served = models.BigIntegerField(help_text="The key's last serve (-1: never).")
    arrival = models.BigIntegerField(help_text="The head waiter's AdmissionResourceWaiter id.")
    ticket = models.CharField(max_length=320)
    queue = models.CharField(max_length=100, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["resource", "other"], name="df_rhead_resource_key")]
        indexes = [
            models.Index(fields=["resource", "-priority", "served", "arrival"], name="df_rhead_rank"),
            models.Index(fields=["other"], name="df_rhead_other"),
        ]


class AdmissionResourceServed(models.Model):
    """When a resource was last served (a serve number, one counter for every resource): by any
    call (`served`) and by a call that needs it alone (`solo`). Ranks the lines of the
    resources its waiters also need."""

    resource = models.CharField(max_length=320, unique=True)
    served = models.BigIntegerField(default=-1)
    solo = models.BigIntegerField(default=-1)

    class Meta:
        indexes = [models.Index(fields=["served"], name="df_rserved_served")]


class AdmissionKeyMark(models.Model):
    """A grant (`kind` "g") or step start ("s") of one fairness key in a per-key rate window;
    deleted once outside the window, so an idle key leaves no row."""

    queue = models.CharField(max_length=100)
    fairness_key = models.CharField(max_length=200)
    kind = models.CharField(max_length=1)
    at_ms = models.BigIntegerField()

    class Meta:
        indexes = [
            models.Index(fields=["queue", "kind", "fairness_key", "at_ms"], name="df_keymark_key"),
            models.Index(fields=["queue", "kind", "at_ms"], name="df_keymark_at"),
        ]


class AdmissionKeyTat(models.Model):
    """A throttle bucket's theoretical arrival time (GCRA), for grants (`kind` "g") or step
    starts ("s"); the bucket is a fairness key, or "" for a queue-wide throttle. Deleted once
    the TAT is past, when the bucket is as good as new."""

    queue = models.CharField(max_length=100)
    bucket = models.CharField(max_length=200)
    kind = models.CharField(max_length=1)
    tat = models.FloatField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["queue", "kind", "bucket"], name="df_keytat_bucket")]
        indexes = [models.Index(fields=["queue", "kind", "tat"], name="df_keytat_tat")]
