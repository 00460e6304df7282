"""Stages: the layers cut into pipeline stages on submeshes, and the micro-batch count."""
