"""Load tests, workloads, offline replay and benchmarks."""
