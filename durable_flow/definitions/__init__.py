"""What users declare in code, with no database: workflows and steps (`registry`), start
quotas, debounce and singleton, per-key step concurrency, CEL keys, JSON checks, declared tasks."""
