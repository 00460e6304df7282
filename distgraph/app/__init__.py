"""The application layer: the Engine and what it needs around a plan (the held state,
the data loader, checks on what users give it, checkpoints and resuming)."""


def __getattr__(name: str):
    # a submodule read as an attribute is imported then, whatever was imported first
    from distgraph import _submodule
    return _submodule(__name__, name)
