"""Benchmarks behind ``aqsgd bench``: codec throughput (and, with the runtime, pipeline speed)."""
