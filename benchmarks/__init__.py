"""Benchmarks of hfrewrite, run from the repository root; not part of the shipped package."""
