"""The read model the admin, the dashboard and the metrics share: history samples and the
busiest keys of step-concurrency constraints."""
