"""Batches of a dataset: the Engine's data loader.

A dataset is any object with ``__len__`` and ``__getitem__`` returning a tuple of numpy
arrays (the inputs followed by the labels), or a dict (a row of a Hugging Face
``datasets.Dataset``, numpy-formatted or not, or of a list of dicts) whose fields
``input_keys`` names in that order. :class:`DataLoader` stacks samples into
batches and shuffles with (seed, epoch); :meth:`DataLoader.read` gives a process only the
fields its program reads and only its rows of each (:func:`reads_of`: the
``ProcessProgram.feeds`` of its plan), reading only the samples those rows hold. Fields
are fed in the model's dtypes: integers as int64, floating point in the default dtype
(``dg.get_default_dtype()``); :meth:`DataLoader.casts` says which fields that casts
from a wider float (the Engine warns once). A dataset from ``dg.shard_dataloader`` (or
the ``sharding`` of one) annotates each field so that its batch comes split.

Example::

    loader = DataLoader(dataset, batch_size=8, shuffle=True, seed=0)
    rows = DataLoader(hf_dataset, batch_size=8, input_keys=["input_ids", "labels"])
    ins, labels = loader.specs(n_labels=1)        # InputSpecs of one batch
    for idx in loader.indices(epoch=0):
        batch = loader.load(idx)                              # every field, every row
        mine = loader.read(idx, list(reads_of(program.feeds, built.feed_names).values()))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distgraph import dtypes
from distgraph.annotation import ShardDataloader, checked_input_keys, sample_fields
from distgraph.app import checks
from distgraph.errors import DistGraphError
from distgraph.trace import InputSpec


def _field_dtype(arr: np.ndarray) -> str:
    if np.issubdtype(arr.dtype, np.integer):
        return "int64"
    if np.issubdtype(arr.dtype, np.bool_):
        return "bool"
    return dtypes.get_default_dtype()


@dataclass(frozen=True)
class FieldRead:
    """What a process reads of field ``field`` of a batch: ``rows``, the batch rows in the
    order it reads them (an index array; None: every row), and ``cut``, its slices of the
    dims after the first."""

    field: int
    rows: object = None
    cut: tuple = ()


def reads_of(feeds, feed_names) -> dict:
    """{input name: FieldRead} of the inputs a process reads: ``feeds`` are its
    ``ProcessProgram.feeds`` (each input's rows per micro-batch, in the order it runs
    them), ``feed_names`` the built program's inputs in the order of a sample's fields."""
    out = {}
    for f in feeds:
        rows = None if f.rows is None else \
            np.concatenate([np.arange(a, b) for a, b in f.rows] or [np.arange(0)])
        out[f.name] = FieldRead(list(feed_names).index(f.name), rows, tuple(f.rest))
    return out


class DataLoader:
    """Stacks dataset samples into batches. ``shuffle`` permutes with (seed, epoch).
    Programs have static shapes, so a short last batch runs on a plan of its own; with
    ``drop_last`` it is dropped instead. ``input_keys`` names the fields of dict samples
    in order (the inputs, then the label); a ``shard_dataloader``'s own are used when it
    is not given. ``dataset`` is the samples as given (the shard_dataloader's dataset)."""

    def __init__(self, dataset, batch_size, shuffle=False, seed=0, drop_last=False,
                 sharding: ShardDataloader | None = None, input_keys=None):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise DistGraphError("a dataset needs __len__ and __getitem__ returning numpy "
                                 "arrays (or dicts of them, with input_keys)")
        if batch_size < 1 or batch_size > len(dataset):
            raise DistGraphError(f"batch_size {batch_size} must be between 1 and the dataset "
                                 f"size {len(dataset)}")
        keys = checked_input_keys(input_keys, "DataLoader")
        if isinstance(dataset, ShardDataloader):
            own = dataset.input_keys
            if keys is not None and own is not None and keys != own:
                raise DistGraphError(f"input_keys {list(keys)} given, but the "
                                     f"shard_dataloader names {list(own)}: give them once")
            keys = own if keys is None else keys
            dataset, sharding = dataset.dataset, dataset
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.drop_last, self.input_keys = drop_last, keys
        self.sharding = sharding
        # a context-parallel shard_dataloader stores each sequence in its balanced order
        self._ordered = sharding if sharding is not None and sharding.sequence_chunks > 1 \
            else None
        self._specs: dict = {}
        self._fed = None

    def sample(self, i: int) -> list:
        """Dataset sample ``i``'s fields in order (a dict sample's at ``input_keys``), the
        sequence in the stored order of a context-parallel shard_dataloader
        (:meth:`ShardDataloader.ordered`)."""
        fields = sample_fields(self.dataset[i], self.input_keys, i)
        return fields if self._ordered is None else list(self._ordered.ordered(fields, i))

    def __len__(self):
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def indices(self, epoch: int) -> list:
        """The sample indices of every batch of ``epoch``."""
        order = np.arange(len(self.dataset))
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(order)
        return [order[b * self.batch_size:(b + 1) * self.batch_size] for b in range(len(self))]

    def load(self, idx, rows: slice | None = None) -> list:
        """One batch of samples ``idx``; ``rows`` keeps only those rows (a data-parallel
        rank reads only its shard of the samples)."""
        if rows is not None:
            idx = idx[rows]
        fed = self.fed_dtypes()
        batch = checks.stack_batch([self.sample(int(i)) for i in idx], idx,
                                   [k for k, t in enumerate(fed) if t == "int64"])
        return [np.asarray(a, dtype=t) for a, t in zip(batch, fed)]

    def read(self, idx, reads) -> list:
        """The arrays ``reads`` (FieldReads) ask for of the batch of samples ``idx``, one
        per read: only the samples some read needs are read, and only the fields asked
        for are made arrays and stacked, each of its rows only, then cut."""
        every = np.arange(len(idx))
        wanted = sorted({int(p) for r in reads for p in (every if r.rows is None else r.rows)})
        if not wanted:             # a process that reads no input (a middle stage)
            return []
        samples = {p: self.sample(int(idx[p])) for p in wanted}
        checks.check_field_counts([samples[p] for p in wanted], idx[wanted])
        out = []
        for r in reads:
            rows = every if r.rows is None else r.rows
            if not len(rows):      # a process that runs no micro-batch of this batch
                out.append(np.empty((0,)))
                continue
            fed = self.fed_dtypes()[r.field]
            batch = checks.stack_field([np.asarray(samples[int(p)][r.field]) for p in rows],
                                       idx[rows], r.field, fed == "int64")
            out.append(np.asarray(batch[(slice(None),) + r.cut], dtype=fed))
        return out

    def fed_dtypes(self) -> list:
        """The dtype each field is fed in: its InputSpec's, from dataset sample 0 (every
        sample's values are cast to it; an integer field takes whole numbers only)."""
        if self._fed is None:
            self._fed = [_field_dtype(a) for a in self.fields()]
        return self._fed

    def epoch(self, epoch: int, rows: slice | None = None):
        """Batches of one epoch (see :meth:`load`)."""
        for idx in self.indices(epoch):
            yield self.load(idx, rows)

    def fields(self) -> list:
        """The fields of the first sample, as arrays."""
        return [np.asarray(f) for f in self.sample(0)]

    def specs(self, n_labels: int, batch_rows: int | None = None):
        """InputSpecs of a batch of ``batch_rows`` samples (default: ``batch_size``),
        annotated where the dataset came from ``dg.shard_dataloader``."""
        rows = batch_rows or self.batch_size
        if (n_labels, rows) not in self._specs:
            first = self.fields()
            if len(first) <= n_labels:
                raise DistGraphError(f"dataset samples have {len(first)} field(s); expected "
                                     f"the model's inputs followed by {n_labels} label "
                                     "field(s)")
            shapes = [(rows,) + a.shape for a in first]
            attrs = (self.sharding.feed_attrs(shapes, n_labels) if self.sharding is not None
                     else [None] * len(first))
            cut = len(first) - n_labels
            chunks = self.sharding.sequence_chunks if self.sharding is not None else 1
            specs = [InputSpec(shape, _field_dtype(a),
                               f"input_{i}" if i < cut else f"label_{i - cut}", attr, chunks)
                     for i, (a, shape, attr) in enumerate(zip(first, shapes, attrs))]
            self._specs[n_labels, rows] = (specs[:cut], specs[cut:])
        return self._specs[n_labels, rows]

    def restored(self, array: np.ndarray) -> np.ndarray:
        """An output of a batch with its dim 1 back in sequence order where the data
        stores sequences in the balanced order of context parallelism (an output whose
        dim 1 is not the sequence is given back as it is)."""
        if self.sharding is None or self.sharding.sequence_chunks == 1:
            return array
        seq = len(self.fields()[0])
        if array.ndim < 2 or array.shape[1] != seq:
            return array
        return self.sharding.restored(array, 1)

    def casts(self) -> list:
        """(field index, dataset dtype, fed dtype) of each floating field fed in a
        narrower float than the dataset's (float64 samples for a float32 model)."""
        out = []
        for i, a in enumerate(self.fields()):
            fed = np.dtype(_field_dtype(a))
            if np.issubdtype(a.dtype, np.floating) and a.dtype.itemsize > fed.itemsize:
                out.append((i, str(a.dtype), str(fed)))
        return out
