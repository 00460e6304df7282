"""How a tensor is laid out on a ProcessMesh: ShardSpec, the placements view, DistAttr.

``ShardSpec.dims`` has one entry per tensor dim: ``None`` (not split), a mesh dim name, or
a tuple of mesh dim names (split over several mesh dims, Alpa's S^{01}). For a tuple
entry the *first* name is the major one: with entry ``("x", "y")`` the process at
coordinates (cx, cy) holds block ``cx * size_y + cy`` of that tensor dim. ``partial`` is
the set of mesh dims over which the local values are pending summands. Mesh dims used
nowhere are replicated.

Example::

    >>> mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    >>> spec = ShardSpec([("x", "y"), None])
    >>> str(spec), spec.to_placements(mesh)
    ('[(x,y), None]', (Shard(dim=0), Shard(dim=0)))
    >>> attr = DistAttr(mesh, spec)
    >>> attr.local_shape((8, 3)), attr.local_slices((8, 3), 2)
    ((2, 3), (slice(4, 6, None), slice(0, 3, None)))
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from distgraph.errors import ShardingError
from distgraph.mesh import ProcessMesh


def format_entry(entry) -> str:
    """How a spec entry prints: None, x, (x,y)."""
    if entry is None:
        return "None"
    if isinstance(entry, tuple):
        return "(" + ",".join(entry) + ")"
    return entry


def _normalise_entry(entry, i: int, dims):
    if entry is None:
        return None
    if isinstance(entry, str):
        if not entry:
            raise ShardingError(f"shard spec {list(dims)!r}: entry {i} is an empty string; "
                                f"use None for an unsplit dim")
        return entry
    if isinstance(entry, (tuple, list)):
        names = tuple(entry)
        if not all(isinstance(n, str) and n for n in names):
            raise ShardingError(f"shard spec {list(dims)!r}: entry {i} {entry!r} must hold "
                                f"only mesh dim names")
        if not names:
            return None
        return names[0] if len(names) == 1 else names
    raise ShardingError(f"shard spec {list(dims)!r}: entry {i} is {entry!r} "
                        f"({type(entry).__name__}); use None, a mesh dim name or a tuple "
                        f"of mesh dim names")


def _plain(dims) -> bool:
    """Whether every entry of ``dims`` is None or a mesh dim name (its normal form)."""
    for e in dims:
        if e is not None and (type(e) is not str or not e):
            return False
    return True


def _plain_partial(partial) -> bool:
    """Whether ``partial`` is a collection of mesh dim names (not one name)."""
    kind = type(partial)
    return (kind is frozenset or kind is tuple or kind is set or kind is list) and \
        _plain(partial) and None not in partial


@dataclass(frozen=True, init=False)
class ShardSpec:
    """Per tensor dim: None | mesh dim name | tuple of names (major first); plus partial.

    Construction normalises the form (lists to tuples, 1-tuples to the plain name); the
    checks that need a mesh and a shape live in :meth:`validate`.
    """

    dims: tuple
    partial: frozenset = frozenset()

    def __init__(self, dims, partial=()):
        kind = type(dims)
        if (kind is tuple or kind is list) and _plain(dims) and _plain_partial(partial):
            # the common form, already normal: entries None or names, partial names
            object.__setattr__(self, "dims", tuple(dims))
            object.__setattr__(self, "partial", frozenset(partial))
            return
        if isinstance(dims, (str, ShardSpec)) or not hasattr(dims, "__iter__"):
            raise ShardingError(f"shard spec {dims!r}: give a list with one entry per "
                                f"tensor dim, e.g. ['x', None]")
        dims = list(dims)
        norm = tuple(_normalise_entry(e, i, dims) for i, e in enumerate(dims))
        if isinstance(partial, str):
            partial = (partial,)
        partial = frozenset(partial)
        if not all(isinstance(p, str) and p for p in partial):
            raise ShardingError(f"shard spec {dims!r}: partial {sorted(map(str, partial))} "
                                f"must hold mesh dim names")
        object.__setattr__(self, "dims", norm)
        object.__setattr__(self, "partial", partial)

    @classmethod
    def replicated(cls, ndim: int) -> "ShardSpec":
        """The spec of a tensor of rank ``ndim`` held whole by every process."""
        return cls([None] * ndim)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def entry(self, tensor_dim: int) -> tuple[str, ...]:
        """Mesh dims splitting ``tensor_dim``, major first (empty if not split)."""
        e = self.dims[tensor_dim]
        return () if e is None else (e,) if isinstance(e, str) else e

    def mesh_dims(self) -> tuple[str, ...]:
        """Mesh dims used, in order: by the dims entries, then the partial ones (sorted)."""
        used = self.__dict__.get("_mesh_dims")     # found once per spec (a value)
        if used is None:
            used = tuple(n for i in range(self.ndim) for n in self.entry(i)) + \
                tuple(sorted(self.partial))
            object.__setattr__(self, "_mesh_dims", used)
        return used

    def tensor_dim_of(self, mesh_dim: str) -> int | None:
        """The tensor dim that ``mesh_dim`` splits, or None."""
        for i in range(self.ndim):
            if mesh_dim in self.entry(i):
                return i
        return None

    def validate_mesh(self, mesh: ProcessMesh, tensor_name: str = "tensor",
                      shape=None, label: str | None = None) -> None:
        """Checks that need only the mesh: known mesh dims, each used at most once."""
        # The message prefix is built only on failure: validation runs on every
        # DistAttr, and formatting a mesh costs more than the checks. The checks read
        # only the mesh's dim names: a spec remembers the last names it passed on.
        names = mesh.dim_names
        if self.__dict__.get("_valid_on") == names:
            return
        used = self.mesh_dims()
        for name in used:
            if name not in mesh.dim_names:
                where = self._where(mesh, tensor_name, shape, label)
                raise ShardingError(f"{where}: unknown mesh dim {name!r}; the mesh dims are "
                                    f"{list(mesh.dim_names)}")
        seen = set()
        for name in used:
            if name in seen:
                where = self._where(mesh, tensor_name, shape, label)
                raise ShardingError(f"{where}: mesh dim {name!r} is used twice; a mesh dim "
                                    f"splits at most one tensor dim and is never both "
                                    f"split and partial")
            seen.add(name)
        object.__setattr__(self, "_valid_on", names)

    def validate(self, mesh: ProcessMesh, shape, tensor_name: str = "tensor",
                 label: str | None = None) -> None:
        """Raise ShardingError (naming tensor, shape, spec and mesh) if this spec cannot
        lay out a tensor of ``shape`` on ``mesh``. ``label`` names the tensor in full
        (``parameter 'fc1.weight' of Linear(16, 64)``) instead of ``tensor '<tensor_name>'``."""
        shape = tuple(shape)
        # The checks read the mesh's dim names and sizes and the shape: a spec remembers
        # the last ones it passed on (most are checked again and again on them).
        key = (mesh.dim_names, mesh.shape, shape)
        if self.__dict__.get("_valid_for") == key:
            return
        if len(shape) != self.ndim:
            where = self._where(mesh, tensor_name, shape, label)
            raise ShardingError(f"{where}: the spec has {self.ndim} entries for a "
                                f"{len(shape)}-d tensor; give one entry per tensor dim")
        self.validate_mesh(mesh, tensor_name, shape, label)
        for i, size in enumerate(shape):
            parts = 1
            for name in self.entry(i):
                parts *= mesh.dim_size(name)
            if size % parts:
                where = self._where(mesh, tensor_name, shape, label)
                raise ShardingError(f"{where}: tensor dim {i} of size {size} is not "
                                    f"divisible by {parts} (the size of mesh dims "
                                    f"{list(self.entry(i))}); pad the tensor or split it "
                                    f"over fewer processes")
        object.__setattr__(self, "_valid_for", key)

    def _where(self, mesh, tensor_name, shape, label=None) -> str:
        shape_s = "" if shape is None else f" of shape {list(shape)}"
        return f"{label or f'tensor {tensor_name!r}'}{shape_s} with spec {self} on {mesh}"

    # ---- placements view ----------------------------------------------------------
    @classmethod
    def from_placements(cls, placements, mesh: ProcessMesh, ndim: int) -> "ShardSpec":
        """One placement per mesh dim -> ShardSpec. Two mesh dims sharding the same
        tensor dim split it in mesh dim order (the earlier mesh dim is major)."""
        placements = tuple(placements)
        if len(placements) != mesh.ndim:
            raise ShardingError(f"placements {list(map(str, placements))} on {mesh}: need "
                                f"one placement per mesh dim ({mesh.ndim})")
        dims: list[list[str]] = [[] for _ in range(ndim)]
        partial = []
        for name, p in zip(mesh.dim_names, placements):
            if isinstance(p, Shard):
                d = p.dim + ndim if p.dim < 0 else p.dim
                if not 0 <= d < ndim:
                    raise ShardingError(f"placement {p} on mesh dim {name!r} of {mesh}: "
                                        f"a {ndim}-d tensor has no dim {p.dim}")
                dims[d].append(name)
            elif isinstance(p, Partial):
                partial.append(name)
            elif not isinstance(p, Replicate):
                raise ShardingError(f"placement {p!r} on mesh dim {name!r}: use Shard(d), "
                                    f"Replicate() or Partial()")
        return cls([tuple(e) for e in dims], partial)

    def to_placements(self, mesh: ProcessMesh) -> tuple:
        """One placement per mesh dim. Fails for a tuple entry not in mesh dim order,
        which placements cannot express."""
        self.validate_mesh(mesh)
        out = []
        for name in mesh.dim_names:
            d = self.tensor_dim_of(name)
            out.append(Partial() if name in self.partial else
                       Replicate() if d is None else Shard(d))
        for i in range(self.ndim):
            entry = self.entry(i)
            if list(entry) != sorted(entry, key=mesh.dim_index):
                raise ShardingError(f"spec {self} on {mesh}: entry {i} {format_entry(self.dims[i])} "
                                    f"is not in mesh dim order, so placements cannot express "
                                    f"it; keep the ShardSpec form")
        return tuple(out)

    def __str__(self) -> str:
        s = "[" + ", ".join(format_entry(e) for e in self.dims) + "]"
        if self.partial:
            s += " P(" + ",".join(sorted(self.partial)) + ")"
        return s


@dataclass(frozen=True)
class Shard:
    """Placement: this mesh dim splits tensor dim ``dim``."""

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, numbers.Integral) or isinstance(self.dim, bool):
            raise ShardingError(f"Shard({self.dim!r}): the tensor dim must be an int")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Placement: every process along this mesh dim holds the same values."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Placement: the values along this mesh dim are summands of the tensor."""

    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class DistAttr:
    """A tensor's mesh and spec. ``spec`` may be given as a list (converted)."""

    mesh: ProcessMesh
    spec: ShardSpec

    def __post_init__(self):
        if not isinstance(self.mesh, ProcessMesh):
            raise ShardingError(f"DistAttr: mesh must be a ProcessMesh, got {self.mesh!r}")
        if not isinstance(self.spec, ShardSpec):
            object.__setattr__(self, "spec", ShardSpec(self.spec))
        self.spec.validate_mesh(self.mesh)

    def parts(self, tensor_dim: int) -> int:
        """Number of blocks tensor dim ``tensor_dim`` is split into."""
        n = 1
        for name in self.spec.entry(tensor_dim):
            n *= self.mesh.dim_size(name)
        return n

    def local_shape(self, global_shape) -> tuple[int, ...]:
        global_shape = tuple(int(s) for s in global_shape)
        self.spec.validate(self.mesh, global_shape)
        return tuple(s // self.parts(i) for i, s in enumerate(global_shape))

    def block_index(self, tensor_dim: int, process_id: int) -> int:
        """Which block of ``tensor_dim`` the process holds (major-first over the entry)."""
        coord = self.mesh.coord(process_id)
        b = 0
        for name in self.spec.entry(tensor_dim):
            axis = self.mesh.dim_index(name)
            b = b * self.mesh.shape[axis] + coord[axis]
        return b

    def local_slices(self, global_shape, process_id: int) -> tuple[slice, ...]:
        """The slices of the global tensor that ``process_id`` holds."""
        local = self.local_shape(global_shape)
        return tuple(slice(self.block_index(i, process_id) * n,
                           (self.block_index(i, process_id) + 1) * n)
                     for i, n in enumerate(local))

    def __str__(self) -> str:
        return f"{self.spec} on {self.mesh}"
