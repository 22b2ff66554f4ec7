"""The read model the admin, the dashboard and the metrics share: what they show of runs
(`runs`, `run_filters`, `timeline`), queues (`queues`, `admission`, `constraint_usage`), workers
(`workers`), start quotas and start control (`quotas`, `start_control`), the overview's tick
(`overview`) and the charts' history (`history`, from the samples `sampling` writes).

The pages and endpoints read through these modules only, never the engine, the admission
backend or the store directly (an import-linter contract in pyproject.toml), so a rule such as
"alive" or "waiting" means one thing on every page.
"""
