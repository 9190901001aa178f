"""Benchmarks (not tests): each prints ratios measured side by side in one run."""
