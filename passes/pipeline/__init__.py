"""Micro-batches and pipelines: gradient accumulation as program structure, and the
task graph each process runs per micro-batch."""
