"""Rank mapping: the process graph of a plan, placed onto the devices of a Cluster."""
