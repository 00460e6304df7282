"""distgraph: a Paddle-style auto-parallel training framework.

Public names (see the README): ``trace``, ``InputSpec``, ``Engine``, ``Strategy``,
``ops``, ``nn``, ``optim``, ``set_default_dtype``, ``seed``, ``LazyGuard``, the error classes, the
distributed attributes ``ProcessMesh``, ``ShardSpec``, ``shard_tensor``, ``shard_op``,
``shard_dataloader``, a layout in one call ``parallelize`` with Paddle's styles
(``ColWiseParallel``, ``RowWiseParallel``, ``SequenceParallelBegin`` / ``End`` / ``Enable``
/ ``Disable``, ``SplitPoint``), and ``__version__``.

Each name is imported the first time it is used (PEP 562), so that what imports only a
part of distgraph pays only for that part: ``distgraph run`` and every rank's bootstrap
import the launcher, not the planner with numpy, scipy and networkx (a second or more of
every rank's start). ``import distgraph as dg; dg.Engine`` and ``from distgraph import
Engine`` work as before; so do paths into submodules (``dg.spmd.UNKNOWN``,
``dg.app.data.DataLoader``), which import everything public first, as before.

Importing distgraph gives this process one BLAS thread, as ``distgraph run`` gives each
rank, unless ``OMP_NUM_THREADS`` (or ``OPENBLAS_``/``MKL_NUM_THREADS``) is set
(:mod:`distgraph.threads`).

Example::

    import distgraph as dg
    mesh = dg.ProcessMesh([0, 1], ["dp"])      # imports distgraph.mesh here
"""

# imported under private names: ``dir(dg)`` and tab completion show the public names,
# not this module's helpers (``__dir__`` below leaves out names with one underscore)
import importlib as _importlib
import sys as _sys
import types as _types

from distgraph.errors import DistGraphError, PlanError, ResourceFileError, RuntimeFault, ShardingError
from distgraph.threads import limit_blas_threads as _limit_blas_threads

_limit_blas_threads()     # one BLAS thread per process unless the user set one (threads.py)

# public name -> the module that defines it
_PUBLIC = {
    "__version__": "distgraph.version",
    "get_default_dtype": "distgraph.dtypes", "seed": "distgraph.dtypes",
    "set_default_dtype": "distgraph.dtypes",
    "Operation": "distgraph.ir", "Program": "distgraph.ir", "Value": "distgraph.ir",
    "LazyGuard": "distgraph.parameter", "Parameter": "distgraph.parameter",
    "DTypeError": "distgraph.registry", "ShapeError": "distgraph.registry",
    "InputSpec": "distgraph.trace", "trace": "distgraph.trace",
    "append_backward": "distgraph.autodiff",
    "Strategy": "distgraph.strategy",
    "Engine": "distgraph.app.engine", "History": "distgraph.app.engine",
    "ProcessMesh": "distgraph.mesh",
    "DistAttr": "distgraph.placement", "Partial": "distgraph.placement",
    "Replicate": "distgraph.placement", "Shard": "distgraph.placement",
    "ShardSpec": "distgraph.placement",
    "shard_dataloader": "distgraph.annotation", "shard_op": "distgraph.annotation",
    "shard_tensor": "distgraph.annotation",
    "parallelize": "distgraph.parallelize",
    "ColWiseParallel": "distgraph.parallel_styles", "RowWiseParallel": "distgraph.parallel_styles",
    "SequenceParallelBegin": "distgraph.parallel_styles",
    "SequenceParallelDisable": "distgraph.parallel_styles",
    "SequenceParallelEnable": "distgraph.parallel_styles",
    "SequenceParallelEnd": "distgraph.parallel_styles",
    "SplitPoint": "distgraph.parallel_styles",
    "Cluster": "distgraph.resources.cluster",
    "get_rank": "distgraph.runtime.launch.status",
    "get_world_size": "distgraph.runtime.launch.status",
    "CheckpointError": "distgraph.errors",
    "PlanFileError": "distgraph.errors",
    "from_pretrained": "distgraph.app.pretrained", "save_pretrained": "distgraph.app.pretrained",
}
# sub-packages that are public names themselves
_SUBPACKAGES = ("ops", "nn", "optim", "passes", "callbacks", "metrics")
# sub-packages of the internals, whose modules the public names' imports bind on them
_INTERNAL_PACKAGES = ("app", "cli", "resources", "runtime", "spmd", "tools")

__all__ = ["DistGraphError", "PlanError", "ResourceFileError", "RuntimeFault", "ShardingError",
           *_PUBLIC, *_SUBPACKAGES]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(_importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBPACKAGES:
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        if name in _INTERNAL_PACKAGES:
            # dg.app.data, dg.resources.cluster, ...: a path into the internals finds
            # what it found when this module imported every public name, so import them
            # all first (not for a module such as ``from distgraph import dtypes``, which
            # distgraph's own modules do while they are being imported)
            for public in __all__:
                getattr(_sys.modules[__name__], public)
        value = _submodule(__name__, name)
    setattr(_sys.modules[__name__], name, value)
    return value


def _submodule(package: str, name: str):
    """The submodule ``name`` of ``package``, imported, or AttributeError where there is
    none. The application's packages (``distgraph.app``, ``distgraph.tools``) have
    this as their own ``__getattr__``: where ``import distgraph.app.state`` bound
    ``dg.app`` before anything public was imported, ``dg.app.data`` is imported when it
    is read, not missing. The lower layers may not import the facade
    (``tests/test_layering.py``), so ``dg.runtime.<module>`` is found as Python finds
    it: once something imported it."""
    if name.startswith("__"):       # what tools probe for (__wrapped__, __test__)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    try:
        return _importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{package}.{name}":
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None


def __dir__():
    # the public names, the submodules imported so far and the dunders; not the helpers
    shown = {name for name in globals() if not name.startswith("_") or name.startswith("__")}
    return sorted(shown | set(__all__))


# submodules that share their name with the public function they define
_NAMESAKES = ("trace", "parallelize")


class _Facade(_types.ModuleType):
    """The package module. Importing a submodule binds it on its package, and two
    submodules share their names with public functions: ``distgraph.trace`` defines
    ``trace``, ``distgraph.parallelize`` ``parallelize``. The names stay the functions, as
    ``trace`` was when everything was imported here."""

    def __setattr__(self, name, value):
        if name in _NAMESAKES and isinstance(value, _types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Facade
