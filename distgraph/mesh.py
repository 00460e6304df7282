"""ProcessMesh: an N-d array of logical process ids with named dims.

A mesh says *which* processes hold a distributed tensor and how they are arranged; a
ShardSpec (see :mod:`distgraph.placement`) then names, per tensor dim, the mesh dims that
split it. Process ids are logical: rank mapping assigns them to devices later.

Example::

    >>> mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    >>> mesh.shape, mesh.dim_size("mp"), mesh.coord(2)
    ((2, 2), 2, (1, 0))
    >>> mesh.groups("dp")          # processes that talk along "dp", ordered by coordinate
    [(0, 2), (1, 3)]
    >>> print(mesh[0])             # an integer index drops that dim
    ProcessMesh([0, 1], dims=[mp])
"""

from __future__ import annotations

import numbers

import numpy as np

from distgraph.errors import ShardingError


_INTS = {int, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8}


def _nested(ids: tuple[int, ...], shape: tuple[int, ...]) -> list:
    return np.array(ids, dtype=np.int64).reshape(shape).tolist()


class ProcessMesh:
    """An immutable, hashable N-d arrangement of distinct non-negative process ids.

    ``mesh`` is a nested list or an ndarray of ints; ``dim_names`` defaults to
    ``("d0", "d1", ...)``. Equality compares ids, shape and dim names.
    """

    __slots__ = ("_ids", "_shape", "_dim_names", "_coords", "_hash")

    def __init__(self, mesh, dim_names=None):
        arr = self._as_array(mesh)
        names = self._check_names(mesh, arr.ndim, dim_names)
        ids = tuple(arr.reshape(-1).tolist())
        object.__setattr__(self, "_ids", ids)
        object.__setattr__(self, "_shape", tuple(int(s) for s in arr.shape))
        object.__setattr__(self, "_dim_names", names)
        # every coordinate at once, row-major as the ids are laid out
        coords = dict(zip(ids, zip(*(c.tolist() for c in np.unravel_index(
            np.arange(len(ids)), arr.shape)))))
        object.__setattr__(self, "_coords", coords)
        object.__setattr__(self, "_hash", hash((ids, self._shape, names)))

    @staticmethod
    def _as_array(mesh) -> np.ndarray:
        # the common case checked at once: a non-empty array of non-negative, distinct
        # ints (no bools); anything else goes the checks below, which name what is wrong
        if isinstance(mesh, np.ndarray) and mesh.dtype.kind in "iu":
            arr = mesh
        else:
            try:
                arr = np.array(mesh, dtype=object)
            except ValueError:
                arr = None
            if arr is not None and arr.ndim and set(map(type, arr.reshape(-1))) <= _INTS:
                arr = arr.astype(np.int64)
        if (arr is not None and arr.dtype.kind in "iu" and arr.ndim and arr.size
                and arr.min() >= 0 and len(np.unique(arr)) == arr.size):
            return arr.astype(np.int64)
        what = f"ProcessMesh({mesh!r})"
        try:
            arr = np.array(mesh, dtype=object)
        except ValueError as exc:
            raise ShardingError(f"{what}: the process ids do not form a rectangular array "
                                f"({exc}); give nested lists of equal length") from None
        if arr.ndim == 0:
            raise ShardingError(f"{what}: a mesh needs at least one dim; "
                                f"wrap a single process id as [{mesh!r}]")
        if arr.size == 0:
            raise ShardingError(f"{what}: the mesh is empty; give at least one process id")
        flat = arr.reshape(-1)
        if any(isinstance(v, (list, tuple, np.ndarray)) for v in flat):
            raise ShardingError(f"{what}: the process ids do not form a rectangular array; "
                                f"give nested lists of equal length")
        for v in flat:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise ShardingError(f"{what}: process id {v!r} is not an int; "
                                    f"process ids are non-negative ints")
            if v < 0:
                raise ShardingError(f"{what}: process id {v} is negative; "
                                    f"process ids are non-negative ints")
        seen, dup = set(), []
        for v in flat:
            if int(v) in seen:
                dup.append(int(v))
            seen.add(int(v))
        if dup:
            raise ShardingError(f"{what}: duplicate process ids {sorted(set(dup))}; "
                                f"each process appears once in a mesh")
        return arr.astype(np.int64)

    @staticmethod
    def _check_names(mesh, ndim: int, dim_names) -> tuple[str, ...]:
        if dim_names is None:
            return tuple(f"d{i}" for i in range(ndim))
        if isinstance(dim_names, str):
            dim_names = [dim_names]
        names = tuple(dim_names)
        what = f"ProcessMesh({mesh!r}, dim_names={list(names)!r})"
        if len(names) != ndim:
            raise ShardingError(f"{what}: {len(names)} dim names for a {ndim}-d mesh; "
                                f"give exactly one name per mesh dim")
        for n in names:
            if not isinstance(n, str) or not n:
                raise ShardingError(f"{what}: dim name {n!r} is not a non-empty string")
        if len(set(names)) != len(names):
            raise ShardingError(f"{what}: duplicated dim names; each mesh dim needs its "
                                f"own name")
        return names

    def __setattr__(self, name, value):
        raise AttributeError("ProcessMesh is immutable")

    def __reduce__(self):
        return (ProcessMesh, (_nested(self._ids, self._shape), list(self._dim_names)))

    # ---- basic properties -------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return len(self._ids)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self._dim_names

    @property
    def process_ids(self) -> list[int]:
        """Flat list of ids in row-major order."""
        return list(self._ids)

    @property
    def mesh(self) -> np.ndarray:
        """A read-only ndarray copy of the ids."""
        arr = np.array(self._ids, dtype=np.int64).reshape(self._shape)
        arr.setflags(write=False)
        return arr

    def dim_index(self, name: str) -> int:
        """Position of mesh dim ``name``; ShardingError if the mesh has no such dim."""
        try:
            return self._dim_names.index(name)
        except ValueError:
            raise ShardingError(f"mesh {self} has no dim {name!r}; its dims are "
                                f"{list(self._dim_names)}") from None

    def dim_size(self, name: str) -> int:
        return self._shape[self.dim_index(name)]

    def coord(self, pid: int) -> tuple[int, ...]:
        """Coordinate of process ``pid`` in the mesh."""
        try:
            return self._coords[int(pid)]
        except (KeyError, TypeError, ValueError):
            raise ShardingError(f"process {pid!r} is not in mesh {self}") from None

    def __contains__(self, pid) -> bool:
        try:
            return int(pid) in self._coords
        except (TypeError, ValueError):
            return False

    # ---- sub-meshes -------------------------------------------------------------
    def __getitem__(self, index) -> "ProcessMesh":
        """Sub-mesh: an integer index drops that dim, a slice keeps it."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > self.ndim:
            raise ShardingError(f"index {index} has more entries than mesh {self} has dims")
        names = []
        for i, idx in enumerate(index):
            if isinstance(idx, slice):
                names.append(self._dim_names[i])
            elif not isinstance(idx, numbers.Integral) or isinstance(idx, bool):
                raise ShardingError(f"mesh {self}: index entry {idx!r} must be an int or "
                                    f"a slice")
        names.extend(self._dim_names[len(index):])
        if not names:
            raise ShardingError(f"mesh {self}: index {index} selects a single process; "
                                f"keep one dim as a slice (e.g. mesh[0, 1:2]) or read "
                                f"mesh.mesh[...] for the id")
        try:
            sub = self.mesh[index]
        except IndexError as exc:
            raise ShardingError(f"mesh {self}: index {index} is out of range ({exc})") from None
        return ProcessMesh(sub, names)

    def get_mesh_with_dim(self, name: str, index: int | None = None) -> "ProcessMesh":
        """The mesh with dim ``name`` moved first; with ``index``, the sub-mesh at that
        coordinate of ``name`` (which drops ``name``), as in Paddle."""
        axis = self.dim_index(name)
        order = [axis] + [i for i in range(self.ndim) if i != axis]
        moved = ProcessMesh(np.transpose(self.mesh, order),
                            [self._dim_names[i] for i in order])
        return moved if index is None else moved[index]

    def reshape(self, shape, dim_names=None) -> "ProcessMesh":
        """Same ids in row-major order, new shape (and names, default d0, d1, ...)."""
        shape = tuple(int(s) for s in shape)
        if int(np.prod(shape)) != self.size:
            raise ShardingError(f"cannot reshape mesh {self} of {self.size} processes to "
                                f"shape {shape}")
        return ProcessMesh(np.array(self._ids).reshape(shape), dim_names)

    def groups(self, dim_name: str) -> list[tuple[int, ...]]:
        """Process groups that communicate along ``dim_name``, each ordered by coordinate."""
        axis = self.dim_index(dim_name)
        moved = np.moveaxis(self.mesh, axis, -1).reshape(-1, self._shape[axis])
        return [tuple(int(v) for v in row) for row in moved]

    def group_of(self, pid: int, dim_name: str) -> tuple[int, ...]:
        """The group along ``dim_name`` that contains ``pid``."""
        axis = self.dim_index(dim_name)
        c = list(self.coord(pid))
        arr = self.mesh
        out = []
        for k in range(self._shape[axis]):
            c[axis] = k
            out.append(int(arr[tuple(c)]))
        return tuple(out)

    def contains_mesh(self, other: "ProcessMesh") -> bool:
        """True if every process of ``other`` is in this mesh."""
        return set(other._ids) <= set(self._ids)

    def to_dict(self) -> dict:
        """Plain data: ``{"process_ids": [...], "shape": [...], "dim_names": [...]}``."""
        return {"process_ids": list(self._ids), "shape": list(self._shape),
                "dim_names": list(self._dim_names)}

    # ---- value semantics --------------------------------------------------------
    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, ProcessMesh):
            return NotImplemented
        return (self._hash == other._hash and self._ids == other._ids
                and self._shape == other._shape and self._dim_names == other._dim_names)

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return (f"ProcessMesh({_nested(self._ids, self._shape)}, "
                f"dims=[{', '.join(self._dim_names)}])")

    def __repr__(self) -> str:
        return (f"ProcessMesh({_nested(self._ids, self._shape)}, "
                f"dim_names={list(self._dim_names)!r})")


class ProcessRanks:
    """Which communicator rank runs each logical process id: the one process-group value
    of a plan (``Plan.ranks``). ``mapping`` ({process: rank}) or None: process p runs on
    rank p. Calling it maps a process to its rank.

    Example::

        >>> ranks = ProcessRanks({0: 1, 1: 0})
        >>> ranks(0), ranks.process(0), ranks.of((0, 1))
        (1, 1, (1, 0))
    """

    __slots__ = ("_rank", "_process")

    def __init__(self, mapping=None):
        rank = None if mapping is None else {int(p): int(r) for p, r in dict(mapping).items()}
        if rank is not None and len(set(rank.values())) != len(rank):
            raise ShardingError(f"ProcessRanks({mapping}): two processes share a rank")
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_process",
                           None if rank is None else {r: p for p, r in rank.items()})

    def __setattr__(self, name, value):
        raise AttributeError("ProcessRanks is immutable")

    def __reduce__(self):
        return ProcessRanks, (self._rank,)

    def __call__(self, process: int) -> int:
        return process if self._rank is None else self._rank[process]

    def of(self, processes) -> tuple:
        """The ranks of ``processes``, in their order (a communicator group)."""
        return tuple(self(p) for p in processes)

    def process(self, rank: int) -> int:
        """The logical process that ``rank`` runs."""
        if self._process is None:
            return rank
        if rank not in self._process:
            raise ShardingError(f"rank {rank} runs no process of this plan (ranks "
                                f"{sorted(self._process)})")
        return self._process[rank]

    @property
    def mapping(self):
        """{process: rank}, or None for the identity."""
        return None if self._rank is None else dict(self._rank)

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessRanks) and self._rank == other._rank

    def __hash__(self) -> int:
        return hash(None if self._rank is None else tuple(sorted(self._rank.items())))

    def __repr__(self) -> str:
        return "ProcessRanks(identity)" if self._rank is None else f"ProcessRanks({self._rank})"
