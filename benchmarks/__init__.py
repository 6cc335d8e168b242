"""Benchmarks: `python -m benchmarks.NAME [--quick]`; each prints ours vs baseline, last line JSON."""
