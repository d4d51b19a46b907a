"""Benchmarks of the reconciliation pass: ``python -m benchmarks --help``."""
