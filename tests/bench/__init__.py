"""The benchmarks' plumbing: every bench's `--json` option, the JSON documents and progress lines
of bench/reporting.py, and bench/run_all.py reading those documents (a fixture, fake benches, one
real bench), so none of it rots between full runs of bench/run_all.py."""
