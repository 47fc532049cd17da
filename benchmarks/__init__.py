"""Benchmarks for omnitrace: plain scripts behind one runner (``python -m benchmarks.run``)."""
