"""The installed distgraph's version (``dg.__version__``, ``distgraph --version``, and
what a checkpoint records)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("distgraph")
except PackageNotFoundError:     # a source tree used without installing it
    __version__ = "unknown"
