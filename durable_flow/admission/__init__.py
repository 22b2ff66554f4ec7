"""Admission backends: `local` (in-process), `db` (exact across one database's processes)
and `redis` (fleet-wide, one Lua script). Chosen by `DURABLE_FLOW["ADMISSION"]`."""

from durable_flow.admission.base import (
    AdmissionBackend,
    AdmissionDecision,
    AdmissionRequest,
    Constraint,
    Grant,
    Ticket,
    system_clock_ms,
)

__all__ = [
    "AdmissionBackend",
    "AdmissionDecision",
    "AdmissionRequest",
    "Constraint",
    "Grant",
    "Ticket",
    "system_clock_ms",
]
