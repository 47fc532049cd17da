"""One-off probes: each answered one question, and its findings are in BENCHMARKS.md or docs/.

Not part of a suite; each runs alone (``python -m benchmarks.probes.<name>``).
"""
