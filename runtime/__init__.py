"""distgraph.runtime: array backends, communicators, executors and the launcher."""
