"""Pure admission rules with no I/O: the policy, rate windows, per-key limits, step-concurrency
resources and the indexed waiting lines the backends share."""
