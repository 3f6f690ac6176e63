"""Benchmarks: conveyor against its peers on the same model and workload, in one run."""
