"""Checkpoint format: per-rank shard files plus one metadata file, committed atomically.

A checkpoint is a directory::

    ckpt/
      metadata.json              the commit point (replaced atomically by each save)
      data-<id>/rank-00000.bin   raw bytes of the shards rank 0 wrote, at 64-byte
      data-<id>/rank-00001.bin   aligned offsets; one file per rank that wrote any

``metadata.json`` holds ``format``/``version``, ``distgraph_version``, ``data`` (the
shard folder it commits), ``world_size``, ``files`` (per shard file its ``bytes`` and
``crc32``, as eight hex digits), ``checksum`` (the crc32 of the metadata itself:
:func:`metadata_checksum`), and per tensor (``tensors``): ``shape``,
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
owns into a temporary folder, computing its file's crc32 as it writes, and fsyncs it;
once every rank succeeded (and sent its file's size and checksum), rank 0 fsyncs
the folder, renames it to ``data-<id>``, writes ``metadata.json`` to a temporary file,
fsyncs it and renames it over the old one (an atomic replace), then removes the previous
data folder. A job killed at any moment leaves a ``metadata.json`` that names complete
files: the previous checkpoint, or the new one. Rank 0 holds the checkpoint's lock
while it saves (:mod:`distgraph.app.checkpoint_lock`), so a save of another job into the
same directory is refused instead of deleting this one's files.

The checksums are crc32 (zlib): it runs at several GB/s (cheaper than writing the
bytes), catches every error of one to 32 neighbouring bits and misses other damage with
a chance of 2**-32; with the recorded sizes that is what accidental damage (a flipped
bit, a truncated or half-copied file) needs. It is no protection against tampering.
Before a checkpoint is loaded, :mod:`distgraph.app.checkpoint_verify` checks them.

Loading (once :func:`distgraph.app.checkpoint_verify.verify` found it whole) reads any
block of any tensor (:meth:`CheckpointReader.read`) from the shards that overlap it,
through memory maps, so a process of a new plan reads only its slices.
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
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from distgraph.app.checkpoint_lock import LOCK_NAME, Lock
from distgraph.errors import CheckpointError

FORMAT = "distgraph-checkpoint"
GLOBAL_STATE = "optimizer@"      # optimizer states of no one parameter (optimizer@STEP)
VERSION = 2              # 2: checksums of the files and of the metadata
READABLE = (1, 2)        # 1: written before checksums, read without verifying
METADATA = "metadata.json"
ALIGN = 64
PHASE_TIMEOUT = 3600.0   # seconds a rank waits for the others to finish a phase of a save


@dataclass(frozen=True)
class Entry:
    """One tensor to save. ``attr`` is its layout (None: every rank holds it whole and
    rank 0 writes it); ``rank_of`` maps a process id of ``attr.mesh`` to its rank;
    ``local`` is this rank's block (None where it holds none). ``padded``: the shape
    ``attr`` lays it out on where it is stored padded (ZeRO's zeros past ``shape``,
    which is what is saved), None where it is not."""

    name: str
    shape: tuple
    dtype: str
    kind: str
    attr: object = None
    rank_of: Callable = lambda pid: pid
    local: object = None
    padded: tuple | None = None


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
                index = e.attr.local_slices(e.padded or e.shape, pid)
                # of a padded block, the part inside the tensor (none: only padding)
                block = tuple((min(s.start, n), min(s.stop, n)) for s, n in zip(index, e.shape))
                if e.padded is None or all(a < b for a, b in block):
                    holders.setdefault(block, []).append(pid)
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


def metadata_checksum(meta: dict) -> str:
    """The crc32 of a checkpoint's metadata without its ``checksum`` entry, as eight hex
    digits: computed over its canonical JSON (sorted keys, no spaces), so what is checked
    is the content that reading the file gives."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def _is_ours(name: str) -> bool:
    return name == METADATA or name.startswith((".tmp-", "data-", METADATA + ".tmp-"))


def _check_directory(path: str) -> None:
    """A checkpoint directory holds only what saves put there (never a user's files,
    which a save's cleanup could take for leftovers)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise CheckpointError(f"cannot save a checkpoint to {path}: it is a file; give a "
                                  f"directory path")
        foreign = sorted(n for n in os.listdir(path) if not _is_ours(n) and n != LOCK_NAME)
        if foreign:
            raise CheckpointError(f"cannot save a checkpoint to {path}: the directory holds "
                                  f"other files ({', '.join(foreign[:5])}); give a new or "
                                  f"checkpoint directory")


def _write_files(tmp: str, rank: int, mine: list) -> tuple:
    """Write this rank's blocks into its shard file, then fsync it: (1, its size, its
    crc32), or (0, 0, 0) where the rank writes none."""
    if not mine:
        return 0, 0, 0
    size, crc = 0, 0
    with open(os.path.join(tmp, f"rank-{rank:05d}.bin"), "wb") as f:
        for e, block, offset in mine:
            local = e.local if e.attr is not None else np.asarray(e.local)[block]
            if e.padded is not None:        # a padded block: its part inside the tensor
                local = np.asarray(local)[tuple(slice(0, s.stop - s.start) for s in block)]
            data = np.asarray(local, dtype=np.dtype(e.dtype))
            if not data.flags.c_contiguous:      # (ascontiguousarray makes 0-d arrays 1-d)
                data = data.copy(order="C")
            if tuple(data.shape) != tuple(s.stop - s.start for s in block):
                raise CheckpointError(f"{e.name}: this rank holds a block of shape "
                                      f"{list(data.shape)}, the layout says "
                                      f"{[s.stop - s.start for s in block]}")
            for chunk in (bytes(offset - size), memoryview(data).cast("B")):
                f.write(chunk)          # the alignment's zeros, then the block
                crc = zlib.crc32(chunk, crc)
            size = offset + data.nbytes
        f.flush()
        os.fsync(f.fileno())
    return 1, size, crc


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
    that were killed. The folder the metadata on disk names stays whatever ``keep`` says
    (a reader of it must find its files)."""
    try:
        with open(os.path.join(path, METADATA)) as f:
            named = json.load(f).get("data")
    except (OSError, ValueError, AttributeError):
        named = None
    for name in os.listdir(path):
        if name not in (keep, named, METADATA) and _is_ours(name):
            full = os.path.join(path, name)
            shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


class Agreement:
    """Runs a phase on one or all ranks and makes every rank fail if any did."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank if comm is not None else 0
        self.size = comm.size if comm is not None else 1

    def phase(self, what: str, fn, on_ranks=None, width: int = 0) -> list:
        """Run ``fn`` (on ``on_ranks``, else on every rank); raise on every rank if it
        raised on any. ``width``: ``fn`` returns that many integers, and the phase
        returns every rank's, in rank order (zeros where it did not run)."""
        error, figures = None, [0] * width
        if on_ranks is None or self.rank in on_ranks:
            try:
                result = fn()
                if width:
                    figures = [int(v) for v in result]
            except Exception as e:     # every rank must learn of it, whatever it was
                error = e
        if self.comm is None:
            if error is not None:
                raise _wrap(what, error)
            return [figures]
        rows = self.gather([error is not None, *figures])
        failed = [r for r, row in enumerate(rows) if row[0]]
        if error is not None:
            raise _wrap(what, error)
        if failed:
            raise CheckpointError(f"{what} failed on rank(s) {failed}; see their errors")
        return [row[1:] for row in rows]

    def gather(self, values) -> list:
        """Every rank's ``values`` (integers, as many on every rank), in rank order."""
        arr = np.array([int(v) for v in values], dtype=np.int64)
        if self.comm is None:
            return [arr.tolist()]
        got = self._long(lambda group: self.comm.all_gather(arr, group))
        return np.asarray(got).reshape(self.comm.size, len(arr)).tolist()

    def most(self, values) -> list:
        """The largest of every rank's ``values`` (integers, as many on every rank)."""
        arr = np.array([int(v) for v in values], dtype=np.int64)
        if self.comm is None or not len(arr):
            return arr.tolist()
        return np.asarray(self._long(lambda group: self.comm.all_reduce(arr, group, op="max"))
                          ).tolist()

    def _long(self, collective):
        # Writing or reading a large checkpoint may take longer than the wait allowed for
        # a step's collectives, so the ranks that finished first wait up to PHASE_TIMEOUT.
        timeout, self.comm.timeout = self.comm.timeout, max(self.comm.timeout, PHASE_TIMEOUT)
        try:
            return collective(tuple(range(self.comm.size)))
        finally:
            self.comm.timeout = timeout

    def token(self) -> int:
        value = int.from_bytes(os.urandom(6), "little") if self.rank == 0 else 0
        return max(row[0] for row in self.gather([value]))


def _wrap(what, error):
    if isinstance(error, CheckpointError):
        return error
    return CheckpointError(f"{what} failed: {type(error).__name__}: {error}")


def save(path, entries, info: dict, comm=None) -> str:
    """Write a checkpoint of ``entries`` (every rank's, same names and layouts) plus the
    ``info`` sections into directory ``path``; collective when ``comm`` is given. Returns
    the name of the committed data folder. A directory another job holds is refused."""
    path = os.path.abspath(os.fspath(path))
    entries = sorted(entries, key=lambda e: e.name)
    agree = Agreement(comm)
    step = int(info.get("training", {}).get("step", 0))
    token = f"step{step}-{agree.token():012x}"
    tmp, data = os.path.join(path, f".tmp-{token}"), f"data-{token}"
    tensors, writes = layout(entries)
    mine = writes.get(agree.rank, [])
    lock = Lock(path)

    def prepare():
        _check_directory(path)
        lock.acquire()
        os.makedirs(tmp)

    try:
        agree.phase(f"preparing checkpoint directory {path}", prepare, on_ranks=(0,))
        written = agree.phase(f"writing the shards of checkpoint {path}",
                              lambda: _write_files(tmp, agree.rank, mine), width=3)
        files = {f"rank-{rank:05d}.bin": {"bytes": size, "crc32": f"{crc:08x}"}
                 for rank, (wrote, size, crc) in enumerate(written) if wrote}
        meta = {"format": FORMAT, "version": VERSION,
                "distgraph_version": distgraph_version(), "data": data,
                "world_size": agree.size, "files": files, "tensors": tensors, **info}
        meta["checksum"] = metadata_checksum(meta)

        def commit():
            _publish_data(path, tmp, data)
            _write_metadata(path, meta, token)
            _cleanup(path, data)

        agree.phase(f"committing checkpoint {path}", commit, on_ranks=(0,))
    finally:
        lock.release()
    return data


def hold(path, comm=None) -> Lock:
    """Take the lock of checkpoint directory (or series) ``path`` for a job that will
    save there (``ModelCheckpoint``, at the start of ``fit``): on rank 0, after the checks
    a save makes first; every rank raises when that fails. Returns the lock, held on rank
    0, to release when the job is done saving. Collective when ``comm`` is given."""
    path = os.path.abspath(os.fspath(path))
    lock = Lock(path)

    def take():
        if "{" not in path:
            _check_directory(path)
        lock.acquire()

    Agreement(comm).phase(f"taking checkpoint directory {path}", take, on_ranks=(0,))
    return lock


# -- loading -------------------------------------------------------------------------------
def read_metadata(path) -> dict:
    """The metadata of the checkpoint at ``path``, checked against its checksum;
    CheckpointError naming the file and what is wrong with it."""
    path = os.path.abspath(os.fspath(path))
    meta_path = os.path.join(path, METADATA)
    if not os.path.isfile(meta_path):
        what = "no such directory" if not os.path.isdir(path) else \
            f"no {METADATA} in it (no save into it ever completed)"
        raise CheckpointError(f"no checkpoint at {path}: {what}")
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read())
    except OSError as e:
        raise CheckpointError(f"cannot read {meta_path}: {e}") from None
    except ValueError as e:
        raise CheckpointError(f"{meta_path} is damaged: it does not parse as JSON "
                              f"({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not a distgraph checkpoint (format "
                              f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") not in READABLE:
        raise CheckpointError(f"{meta_path} has checkpoint format version "
                              f"{meta.get('version')}; this distgraph reads versions "
                              f"{', '.join(map(str, READABLE))}")
    if meta["version"] >= 2 and meta.get("checksum") != metadata_checksum(meta):
        raise CheckpointError(f"{meta_path} is damaged: its content does not match its "
                              f"checksum (recorded {meta.get('checksum')}, content "
                              f"{metadata_checksum(meta)})")
    return meta


class CheckpointReader:
    """A committed checkpoint: its metadata, and blocks of its tensors read on demand.

    Example::

        r = CheckpointReader("ckpt")
        r.names, r.shape("fc1.weight"), r.info["training"]["step"]
        r.read("fc1.weight")                      # the whole tensor
    """

    def __init__(self, path, strip_prefix: str = "", prefix: str = ""):
        self.path = os.path.abspath(os.fspath(path))
        meta = read_metadata(self.path)
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
