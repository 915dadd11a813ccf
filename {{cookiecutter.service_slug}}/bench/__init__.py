"""Benchmarks of the service (run with `make bench`)."""
