"""Deterministic workload generators and trace readers."""
