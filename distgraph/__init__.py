"""distgraph: a Paddle-style auto-parallel training framework.

Public names (see the README): ``trace``, ``InputSpec``, ``Engine``, ``Strategy``,
``ops``, ``nn``, ``optim``, ``set_default_dtype``, ``seed``, ``LazyGuard``, the error classes, the
distributed attributes ``ProcessMesh``, ``ShardSpec``, ``shard_tensor``, ``shard_op``,
``shard_dataloader``, and ``__version__``.
"""

from distgraph.version import __version__

from distgraph.errors import DistGraphError, PlanError, ResourceFileError, RuntimeFault, ShardingError
from distgraph.dtypes import get_default_dtype, seed, set_default_dtype
from distgraph import ops
from distgraph.ir import Operation, Program, Value
from distgraph.parameter import LazyGuard, Parameter
from distgraph.registry import DTypeError, ShapeError
from distgraph.trace import InputSpec, trace
from distgraph import nn, optim
from distgraph.autodiff import append_backward
from distgraph.strategy import Strategy
from distgraph.app.engine import Engine, History
from distgraph.mesh import ProcessMesh
from distgraph.placement import DistAttr, Partial, Replicate, Shard, ShardSpec
from distgraph.annotation import shard_dataloader, shard_op, shard_tensor
from distgraph import passes
from distgraph.resources.cluster import Cluster
from distgraph import callbacks, metrics
from distgraph.app.checkpoint import CheckpointError
