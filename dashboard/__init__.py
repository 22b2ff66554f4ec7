"""The staff dashboard: queue backlogs, worker cards and runs, pushed live over a WebSocket."""
