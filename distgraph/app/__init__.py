"""The application layer: the Engine and what it needs around a plan (the held state,
the data loader, checks on what users give it, checkpoints and resuming)."""
