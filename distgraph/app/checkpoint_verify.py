"""Checking a whole checkpoint before it is loaded, with the same verdict on every rank.

:func:`verify` reads the metadata (against its own checksum:
:func:`~distgraph.app.checkpoint.read_metadata`), checks that every shard file it names
is there with the size it records, then the files' crc32: file i by rank i mod the world
size, so the job reads the checkpoint once whatever its size, and an all-reduce tells
every rank which files differ. An all-gather first makes sure every rank read the same
metadata for the same path, so the ranks all load a checkpoint or all refuse it.
:func:`newest` walks the checkpoints of a series (``ck/step-{step}``), newest first, and
returns the first that verifies, with the verdicts of the newer ones it skipped.

A checkpoint of format version 1 (written before checksums) has only its files' presence
checked: :attr:`Verdict.unverified` says so.

Example::

    verdict = verify("ckpt", comm)           # collective when comm is given
    if not verdict.ok: print(verdict)        # "…/rank-00001.bin is 812 bytes, …"
    path, skipped = newest("ck/step-{step}", comm)
"""

from __future__ import annotations

import glob
import json
import os
import re
import zlib
from dataclasses import dataclass

from distgraph.app.checkpoint import METADATA, Agreement, read_metadata
from distgraph.errors import CheckpointError

CHUNK = 1 << 22          # bytes read at a time while checking a file


@dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found at ``path``: its ``meta`` when whole, else the
    ``problems`` (one line each, naming the file); ``absent``: there is no checkpoint
    there at all (no metadata: never saved, or its first save did not finish)."""

    path: str
    meta: dict | None
    problems: tuple = ()
    absent: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unverified(self) -> bool:
        return self.meta is not None and self.meta.get("version", 0) < 2

    def __str__(self) -> str:
        return "; ".join(self.problems) if self.problems else f"{self.path}: verified"


def _crc(fname: str) -> int:
    crc, buf = 0, bytearray(CHUNK)
    view = memoryview(buf)
    with open(fname, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def _local(path: str) -> tuple:
    """(metadata or None, problems, absent) from what this rank sees: the metadata and
    the files' presence and sizes (cheap: no file is read)."""
    try:
        meta = read_metadata(path)
    except CheckpointError as e:
        return None, [str(e)], not os.path.isfile(os.path.join(path, METADATA))
    data = os.path.join(path, meta.get("data", ""))
    named = {s["file"] for t in meta.get("tensors", {}).values() for s in t.get("shards", [])}
    files = meta.get("files")
    if meta["version"] < 2:
        files = {name: None for name in named}
    problems = [f"{os.path.join(path, METADATA)} names shard file {name} but records no "
                f"checksum of it" for name in sorted(named - set(files))]
    for name, record in sorted(files.items()):
        fname = os.path.join(data, name)
        try:
            size = os.stat(fname).st_size
        except OSError as e:
            problems.append(f"{fname} is missing ({e.strerror})")
            continue
        if record is not None and size != record["bytes"]:
            how = "cut short" if size < record["bytes"] else "longer than written"
            problems.append(f"{fname} is {size} bytes, the metadata records "
                            f"{record['bytes']}: {how}")
    return meta, problems, False


def verify(path, comm=None, label: str = "") -> Verdict:
    """The :class:`Verdict` on the checkpoint at ``path``, the same on every rank
    (collective when ``comm`` is given; module docstring). ``label`` tells the ranks'
    calls apart in a walk over several checkpoints (they must all check the same)."""
    path = os.path.abspath(os.fspath(path))
    meta, problems, absent = _local(path)
    agree = Agreement(comm)
    seen = zlib.crc32(json.dumps(meta, sort_keys=True).encode()) if meta is not None else 0
    rows = agree.gather([bool(problems), absent, seen, zlib.crc32(f"{label}{path}".encode())])
    if len({row[3] for row in rows}) > 1:
        raise CheckpointError(f"the ranks were checking different checkpoints ({path} on "
                              f"rank {agree.rank}): is it on a filesystem every rank sees?")
    if any(row[0] for row in rows) or len({row[2] for row in rows}) > 1:
        if not problems:
            bad = [r for r, row in enumerate(rows) if row[0]]
            problems = [f"rank(s) {bad} found checkpoint {path} damaged (their logs say "
                        f"how)" if bad else f"the ranks read different metadata at "
                        f"{path}: is it on a filesystem every rank sees?"]
        return Verdict(path, None, tuple(problems), all(row[1] for row in rows))
    if meta["version"] < 2:
        return Verdict(path, meta)
    names = sorted(meta["files"])
    data = os.path.join(path, meta["data"])
    bad = [0] * len(names)
    for i in range(agree.rank, len(names), agree.size):
        bad[i] = int(_crc(os.path.join(data, names[i])) != int(meta["files"][names[i]]["crc32"], 16))
    bad = agree.most(bad)
    problems = [f"{os.path.join(data, name)} does not match its recorded crc32 "
                f"{meta['files'][name]['crc32']}: its content is damaged"
                for name, b in zip(names, bad) if b]
    return Verdict(path, None if problems else meta, tuple(problems))


def _step(path: str) -> int:
    """The step a checkpoint's metadata records, unchecked (only to order them)."""
    try:
        with open(os.path.join(path, METADATA)) as f:
            return int(json.load(f)["training"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def candidates(pattern) -> list:
    """The checkpoints at ``pattern`` (a folder, or a path with ``{step}`` / ``{epoch}``:
    every folder it matches), newest (highest step recorded) first."""
    pattern = os.fspath(pattern)
    if "{" not in pattern:
        return [pattern]
    found = glob.glob(re.sub(r"\{[^}]*\}", "*", pattern))
    return sorted(found, key=lambda p: (_step(p), p), reverse=True)


def newest(pattern, comm=None) -> tuple:
    """(the newest checkpoint at ``pattern`` that verifies completely, or None; the
    verdicts of the newer ones skipped, damaged or never completed). Collective when
    ``comm`` is given."""
    found = candidates(pattern)
    skipped = []
    for i, path in enumerate(found):
        verdict = verify(path, comm, label=f"{i}/{len(found)} ")
        if verdict.ok:
            return path, skipped
        skipped.append(verdict)
    return None, skipped
