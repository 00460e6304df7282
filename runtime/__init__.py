"""distgraph.runtime: array backends, communicators, executors and the launcher."""


def __getattr__(name: str):
    # a submodule read as an attribute is imported then, whatever was imported first
    from distgraph import _submodule
    return _submodule(__name__, name)
