"""Debugging: per-layer activation traces of a step and a diff naming the first divergence (`trace`)."""
