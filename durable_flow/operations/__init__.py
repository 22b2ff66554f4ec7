"""What people do to runs and queues: the public API functions (`api`), retry, re-run,
pause and resize (`runs`), bulk operations by filter (`bulk`), the forms that start a run or
send a signal (`forms`) and the audit trail (`audit`). Which runs a filter means is read in
`durable_flow.observe.run_filters`."""
