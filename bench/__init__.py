"""Throughput benchmarks; each writes bench/results/NAME.json and a PNG."""
