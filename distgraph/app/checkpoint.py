"""Checkpoint format: per-rank shard files plus one metadata file, committed atomically.

A checkpoint is a directory::

    ckpt/
      metadata.json              the commit point (replaced atomically by each save)
      data-<id>/rank-00000.bin   raw bytes of the shards rank 0 wrote, at 64-byte
      data-<id>/rank-00001.bin   aligned offsets; one file per rank that wrote any

``metadata.json`` holds ``format``/``version``, ``distgraph_version``, ``data`` (the
shard folder it commits), ``world_size``, and per tensor (``tensors``): ``shape``,
``dtype`` (numpy's byte-order-explicit string, e.g. ``<f8``), ``kind`` ("parameter" or
"optimizer"), ``mesh`` (process ids, shape, dim names), ``spec`` (as ``[dp, None]``)
and ``shards``: for each distinct block, the ``file``, byte ``offset``, ``start`` (global
index of its first element per dim) and ``shape``. A block held by several processes
(replicated) is written once, by the holder whose file is the smallest so far (the
lowest process id on a tie), which spreads replicated tensors over the ranks. The caller adds
``training`` (step, epoch, batch position, batch size, shuffle, dataset size),
``optimizer`` (type, hyper-parameters, learning rate or schedule) and ``rng`` (data
seed, dropout seeds, the parameter generator's state).

Saving is collective (every rank calls :func:`save`): each rank writes the blocks it
owns into a temporary folder and fsyncs them; once every rank succeeded, rank 0 fsyncs
the folder, renames it to ``data-<id>``, writes ``metadata.json`` to a temporary file,
fsyncs it and renames it over the old one (an atomic replace), then removes the previous
data folder. A job killed at any moment leaves a ``metadata.json`` that names complete
files: the previous checkpoint, or the new one.

Loading reads any block of any tensor (:meth:`CheckpointReader.read`) from the shards
that overlap it, through memory maps, so a process of a new plan reads only its slices.
The directory must be on a filesystem every rank sees.

Example::

    save("ckpt", entries, {"training": {"step": 10}}, comm)     # on every rank
    reader = CheckpointReader("ckpt")
    reader.read("fc1.weight", (slice(0, 8), slice(0, 4)))       # one block, from the shards
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Callable

import numpy as np

from distgraph.errors import DistGraphError

FORMAT = "distgraph-checkpoint"
GLOBAL_STATE = "optimizer@"      # optimizer states of no one parameter (optimizer@STEP)
VERSION = 1
METADATA = "metadata.json"
ALIGN = 64
PHASE_TIMEOUT = 3600.0   # seconds a rank waits for the others to finish a phase of a save


class CheckpointError(DistGraphError):
    """A checkpoint cannot be written, read, or does not fit the model."""


@dataclass(frozen=True)
class Entry:
    """One tensor to save. ``attr`` is its layout (None: every rank holds it whole and
    rank 0 writes it); ``rank_of`` maps a process id of ``attr.mesh`` to its rank;
    ``local`` is this rank's block (None where it holds none)."""

    name: str
    shape: tuple
    dtype: str
    kind: str
    attr: object = None
    rank_of: Callable = lambda pid: pid
    local: object = None


def distgraph_version() -> str:
    from distgraph.version import __version__     # importlib.metadata: only when saving
    return __version__


def _mesh_dict(mesh) -> dict:
    return {"process_ids": list(mesh.process_ids), "shape": list(mesh.shape),
            "dim_names": list(mesh.dim_names)}


def layout(entries) -> tuple[dict, dict]:
    """Where every block goes, computed alike on every rank from the entries' layouts:
    (``tensors`` metadata, {rank: [(entry, block index, offset)]}) ."""
    tensors, writes, sizes = {}, {}, {}
    for e in entries:
        itemsize = np.dtype(e.dtype).itemsize
        blocks: dict = {}
        if e.attr is None:
            blocks[tuple((0, n) for n in e.shape)] = 0
            mesh, spec = {"process_ids": [0], "shape": [1], "dim_names": ["world"]}, \
                str([None] * len(e.shape)).replace("'", "")
        else:
            holders: dict = {}
            for pid in sorted(e.attr.mesh.process_ids):
                index = e.attr.local_slices(e.shape, pid)
                holders.setdefault(tuple((s.start, s.stop) for s in index), []).append(pid)
            for block, pids in holders.items():   # the holder that has written least
                blocks[block] = min((sizes.get(e.rank_of(p), 0), p) for p in pids)[1]
            blocks = {block: e.rank_of(pid) for block, pid in blocks.items()}
            mesh, spec = _mesh_dict(e.attr.mesh), str(e.attr.spec)
        shards = []
        for block, rank in blocks.items():
            shape = [b - a for a, b in block]
            offset = -(-sizes.get(rank, 0) // ALIGN) * ALIGN
            sizes[rank] = offset + int(np.prod(shape, dtype=np.int64)) * itemsize
            fname = f"rank-{rank:05d}.bin"
            shards.append({"file": fname, "offset": offset, "start": [a for a, _ in block],
                           "shape": shape})
            writes.setdefault(rank, []).append((e, tuple(slice(a, b) for a, b in block),
                                                offset))
        tensors[e.name] = {"shape": list(e.shape), "dtype": np.dtype(e.dtype).str,
                           "kind": e.kind, "mesh": mesh, "spec": spec, "shards": shards}
    return tensors, writes


# -- saving --------------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_ours(name: str) -> bool:
    return name == METADATA or name.startswith((".tmp-", "data-", METADATA + ".tmp-"))


def _prepare(path: str, tmp: str) -> None:
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"cannot save a checkpoint to {path}: it is a file; give a "
                                  f"directory path")
        foreign = sorted(n for n in os.listdir(path) if not _is_ours(n))
        if foreign:
            raise CheckpointError(f"cannot save a checkpoint to {path}: the directory holds "
                                  f"other files ({', '.join(foreign[:5])}); give a new or "
                                  f"checkpoint directory")
    os.makedirs(tmp)


def _write_files(tmp: str, rank: int, mine: list) -> None:
    """Write this rank's blocks into its shard file, then fsync it."""
    if not mine:
        return
    with open(os.path.join(tmp, f"rank-{rank:05d}.bin"), "wb") as f:
        for e, block, offset in mine:
            f.seek(offset)
            local = e.local if e.attr is not None else np.asarray(e.local)[block]
            data = np.asarray(local, dtype=np.dtype(e.dtype))
            if not data.flags.c_contiguous:      # (ascontiguousarray makes 0-d arrays 1-d)
                data = data.copy(order="C")
            if tuple(data.shape) != tuple(s.stop - s.start for s in block):
                raise CheckpointError(f"{e.name}: this rank holds a block of shape "
                                      f"{list(data.shape)}, the layout says "
                                      f"{[s.stop - s.start for s in block]}")
            f.write(memoryview(data).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def _publish_data(path: str, tmp: str, data: str) -> None:
    _fsync_dir(tmp)
    os.rename(tmp, os.path.join(path, data))
    _fsync_dir(path)


def _write_metadata(path: str, meta: dict, token: str) -> None:
    staging = os.path.join(path, f"{METADATA}.tmp-{token}")
    with open(staging, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, os.path.join(path, METADATA))
    _fsync_dir(path)


def _cleanup(path: str, keep: str) -> None:
    """Remove what no committed metadata names: older data folders, leftovers of saves
    that were killed."""
    for name in os.listdir(path):
        if name != keep and name != METADATA and _is_ours(name):
            full = os.path.join(path, name)
            shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


class _Agreement:
    """Runs a phase on one or all ranks and makes every rank fail if any did."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank if comm is not None else 0

    def phase(self, what: str, fn, on_ranks=None) -> None:
        error = None
        if on_ranks is None or self.rank in on_ranks:
            try:
                fn()
            except Exception as e:     # every rank must learn of it, whatever it was
                error = e
        if self.comm is None:
            if error is not None:
                raise _wrap(what, error)
            return
        group = tuple(range(self.comm.size))
        # Writing a large checkpoint may take longer than the wait allowed for a step's
        # collectives, so the ranks that finished first wait up to PHASE_TIMEOUT here.
        timeout, self.comm.timeout = self.comm.timeout, max(self.comm.timeout, PHASE_TIMEOUT)
        try:
            flags = self.comm.all_gather(np.array([error is not None], dtype=np.int64), group)
        finally:
            self.comm.timeout = timeout
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if error is not None:
            raise _wrap(what, error)
        if failed:
            raise CheckpointError(f"{what} failed on rank(s) {failed}; see their errors")

    def token(self) -> int:
        value = int.from_bytes(os.urandom(6), "little") if self.rank == 0 else 0
        if self.comm is None:
            return value
        arr = np.array([value], dtype=np.int64)
        return int(self.comm.all_reduce(arr, tuple(range(self.comm.size)), op="max")[0])


def _wrap(what, error):
    if isinstance(error, CheckpointError):
        return error
    return CheckpointError(f"{what} failed: {type(error).__name__}: {error}")


def save(path, entries, info: dict, comm=None) -> str:
    """Write a checkpoint of ``entries`` (every rank's, same names and layouts) plus the
    ``info`` sections into directory ``path``; collective when ``comm`` is given. Returns
    the name of the committed data folder."""
    path = os.path.abspath(os.fspath(path))
    entries = sorted(entries, key=lambda e: e.name)
    agree = _Agreement(comm)
    step = int(info.get("training", {}).get("step", 0))
    token = f"step{step}-{agree.token():012x}"
    tmp, data = os.path.join(path, f".tmp-{token}"), f"data-{token}"
    tensors, writes = layout(entries)
    mine = writes.get(agree.rank, [])
    agree.phase(f"preparing checkpoint directory {path}", lambda: _prepare(path, tmp),
                on_ranks=(0,))
    agree.phase(f"writing the shards of checkpoint {path}",
                lambda: _write_files(tmp, agree.rank, mine))
    meta = {"format": FORMAT, "version": VERSION, "distgraph_version": distgraph_version(),
            "data": data, "world_size": comm.size if comm is not None else 1,
            "tensors": tensors, **info}

    def commit():
        _publish_data(path, tmp, data)
        _write_metadata(path, meta, token)
        _cleanup(path, data)

    agree.phase(f"committing checkpoint {path}", commit, on_ranks=(0,))
    return data


# -- loading -------------------------------------------------------------------------------
def complete(path) -> dict | None:
    """The metadata of the checkpoint at ``path`` when it is complete (its
    ``metadata.json`` reads and every file it names exists), else None. A save killed
    midway leaves the previous metadata, which names the previous files: still complete."""
    try:
        with open(os.path.join(path, METADATA)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if meta.get("format") != FORMAT:
        return None
    data = os.path.join(path, meta.get("data", ""))
    files = {s["file"] for t in meta.get("tensors", {}).values() for s in t.get("shards", [])}
    if not all(os.path.isfile(os.path.join(data, name)) for name in files):
        return None
    return meta


def newest(pattern) -> str | None:
    """The newest complete checkpoint at ``pattern``: a folder, or a path holding
    ``{step}`` / ``{epoch}`` (``ModelCheckpoint``'s), of which the complete one with the
    highest step wins; None when there is none."""
    import glob
    import re

    pattern = str(pattern)
    if "{" not in pattern:
        return pattern if complete(pattern) is not None else None
    found = []
    for path in glob.glob(re.sub(r"\{[^}]*\}", "*", pattern)):
        meta = complete(path)
        if meta is not None:
            found.append((int(meta.get("training", {}).get("step", 0)), path))
    return max(found)[1] if found else None


class CheckpointReader:
    """A committed checkpoint: its metadata, and blocks of its tensors read on demand.

    Example::

        r = CheckpointReader("ckpt")
        r.names, r.shape("fc1.weight"), r.info["training"]["step"]
        r.read("fc1.weight")                      # the whole tensor
    """

    def __init__(self, path, strip_prefix: str = "", prefix: str = ""):
        self.path = os.path.abspath(os.fspath(path))
        meta_path = os.path.join(self.path, METADATA)
        if not os.path.isfile(meta_path):
            what = "no such directory" if not os.path.isdir(self.path) else \
                f"no {METADATA} in it (no save into it ever completed)"
            raise CheckpointError(f"no checkpoint at {self.path}: {what}")
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {meta_path}: {e}") from None
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{meta_path} is not a distgraph checkpoint (format "
                                  f"{meta.get('format')!r})")
        if meta.get("version") != VERSION:
            raise CheckpointError(f"{meta_path} has checkpoint format version "
                                  f"{meta.get('version')}; this distgraph reads version "
                                  f"{VERSION}")
        self.meta = meta
        self.tensors = _renamed(meta["tensors"], strip_prefix, prefix)
        self.data_dir = os.path.join(self.path, meta["data"])
        self.bytes_read = 0     # bytes copied out of shard files by read()

    @property
    def names(self) -> list:
        return sorted(self.tensors)

    @property
    def info(self) -> dict:
        return self.meta

    @property
    def has_optimizer_state(self) -> bool:
        return any(t["kind"] == "optimizer" for t in self.tensors.values())

    def shape(self, name) -> tuple:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name) -> str:
        return np.dtype(self.tensors[name]["dtype"]).name

    def kind(self, name) -> str:
        return self.tensors[name]["kind"]

    def read(self, name, index=None) -> np.ndarray:
        """The block ``index`` (a tuple of unit-step slices; None: everything) of tensor
        ``name``, read from the shards that overlap it only."""
        t = self.tensors[name]
        shape, dtype = tuple(t["shape"]), np.dtype(t["dtype"])
        if index is None:
            index = tuple(slice(0, n) for n in shape)
        region = [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape)]
        out = np.empty([b - a for a, b in region], dtype=dtype.newbyteorder("="))
        filled = 0
        for shard in t["shards"]:
            start, sshape = shard["start"], shard["shape"]
            inter = [(max(a, s), min(b, s + n)) for (a, b), s, n in zip(region, start, sshape)]
            if any(a >= b for a, b in inter):
                continue
            src = tuple(slice(a - s, b - s) for (a, b), s in zip(inter, start))
            dst = tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(inter, region))
            out[dst] = self._shard(name, shard, dtype)[src]
            n = int(np.prod([b - a for a, b in inter], dtype=np.int64))
            filled += n
            self.bytes_read += n * dtype.itemsize
        if filled != out.size:
            raise CheckpointError(f"checkpoint {self.path}: the shards of {name} cover "
                                  f"{filled} of the {out.size} elements asked for; the "
                                  f"checkpoint is damaged")
        return out

    def _shard(self, name, shard, dtype):
        fname = os.path.join(self.data_dir, shard["file"])
        shape = tuple(shard["shape"])
        try:
            if shape == ():
                return np.fromfile(fname, dtype=dtype, count=1,
                                   offset=shard["offset"]).reshape(())
            return np.memmap(fname, dtype=dtype, mode="r", offset=shard["offset"], shape=shape)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {self.path}: cannot read the shard of {name} "
                                  f"in {fname}: {e}") from None


def _renamed(tensors: dict, strip_prefix: str, prefix: str) -> dict:
    """The checkpoint's tensors under the names a model of another nesting uses: a
    leading ``strip_prefix`` removed, then ``prefix`` put in front (global optimizer
    states such as ``optimizer@STEP`` keep their names)."""
    if not strip_prefix and not prefix:
        return tensors
    out = {}
    for name, t in tensors.items():
        if name.startswith(GLOBAL_STATE):
            out[name] = t
            continue
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix):]
        out[prefix + name] = t
    return out


def _prefix_hint(have: set, expected: set, allowed_missing: set) -> str:
    """How to load anyway when the checkpoint's names and the model's differ only by a
    common leading prefix (a model saved inside a wrapper layer and loaded bare, or the
    reverse); "" when they do not."""
    theirs = {n for n in have if not n.startswith(GLOBAL_STATE)}
    ours = {n for n in expected if not n.startswith(GLOBAL_STATE)}
    need = ours - set(allowed_missing)

    def fits(renamed: set) -> bool:
        return bool(renamed) and renamed <= ours and need <= renamed

    for arg, longer, shorter in (("strip_prefix", theirs, ours), ("prefix", ours, theirs)):
        cuts = {n[:len(n) - len(m)] for n in longer for m in shorter
                if len(n) > len(m) and n.endswith("." + m)}
        for cut in sorted(cuts, key=len):
            renamed = ({n[len(cut):] for n in theirs if n.startswith(cut)}
                       if arg == "strip_prefix" else {cut + n for n in theirs})
            if len(renamed) == len(theirs) and fits(renamed):
                whose = "checkpoint's" if arg == "strip_prefix" else "model's"
                return (f"The names differ by a common prefix: the {whose} start with "
                        f"{cut!r}. Load it with engine.load(path, {arg}={cut!r})")
    return ""


def _names(names: list, limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}" + (f", ... ({len(names) - limit} more)]" if len(names) > limit else "]")


def check_tensors(reader: CheckpointReader, expected: dict, allowed_missing=(),
                  hint: str = "") -> None:
    """Raise CheckpointError naming every tensor the model expects ({name: (shape,
    dtype)}) that the checkpoint lacks, holds extra, or holds with another shape or
    dtype. Names in ``allowed_missing`` may be absent; ``hint`` ends the message."""
    have = set(reader.tensors)
    missing = sorted(set(expected) - have - set(allowed_missing))
    extra = sorted(have - set(expected))
    wrong = []
    for name in sorted(have & set(expected)):
        shape, dtype = expected[name]
        if reader.shape(name) != tuple(shape) or reader.dtype(name) != dtype:
            wrong.append(f"{name} is {list(reader.shape(name))}:{reader.dtype(name)} in the "
                         f"checkpoint, {list(shape)}:{dtype} in the model")
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) {_names(missing)}")
        if extra:
            parts.append(f"unexpected {len(extra)} tensor(s) {_names(extra)}")
        if wrong:
            parts.append(f"mismatched {len(wrong)}: " + "; ".join(wrong[:8]))
        hint = _prefix_hint(have, set(expected), set(allowed_missing)) or hint
        raise CheckpointError(f"checkpoint {reader.path} does not fit this model: "
                              + "; ".join(parts) + ". " + (hint or "Load a checkpoint saved "
                              "from the same model and optimizer (and the same "
                              "dg.set_default_dtype)"))
