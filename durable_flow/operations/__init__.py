"""What people do to runs and queues: the public API functions (`api`), retry, re-run,
pause and resize (`runs`), bulk operations by filter (`bulk`), the filters (`run_filters`) and
the audit trail (`audit`)."""
