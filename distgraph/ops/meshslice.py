"""MeshSlice, the distributed form of a 2-D sharded matmul (Nam et al., §3.1).

A matmul whose operands come in one of MeshSlice's layouts
(:mod:`distgraph.spmd.meshslice`: OS, LS or RS on mesh dims u, v) runs here with K
slices. Each process cuts its shard of the sliced letter into K blocked sub-shards and,
for k = 0 .. K-1, all-gathers sub-shard k (``iall_gather``: a nonblocking collective),
multiplies it (a partial GeMM) and, for LS and RS, reduce-scatters the partial product
(``ireduce_scatter``). The loop is software-pipelined: slice k+1's all-gathers are in
flight while slice k is multiplied, and slice k's reduce-scatter while slice k+1 is.
During a partial GeMM the kernel tests its requests between row blocks, which is what
moves MPI's nonblocking collectives on. K = 1 is the collective 2-D GeMM: one
all-gather per direction (or all-gather and reduce-scatter) and one GeMM.

Per process (A, B, C the logical operands: ``x`` or ``x^T``, ``y`` or ``y^T``, the result):

- OS: ``C += gather_v(A_k) @ gather_u(B_k)`` (k slices A's k columns and B's k rows);
- LS: ``C_k = scatter_v(A @ gather_u(B_k))`` (k slices n);
- RS: ``C_k = scatter_u(gather_v(A_k) @ B)`` (k slices m).

The matmul op's ``localize`` turns its ``meshslice`` attribute into a
:class:`LocalMeshSlice` (and its mesh groups into the kernel context), its ``comm`` hook
lists the 2K partial collectives (one process sends the bytes of the unsliced
collectives, K calls of each), and its ``overlap`` hook describes the pipeline for the
cost model.

Example (a kernel call as the executor makes it, on a process of a 2 x 2 mesh)::

    local = LocalMeshSlice("OS", "x", "y", 2, 2, 0, slices=4, length=64, parts=(2, 2))
    ctx = KernelContext(np, comm=comm, groups=((0, 2), (0, 1)))
    c = run(ctx, x_shard, y_shard, False, False, local)
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph import dtypes
from distgraph.registry import Overlap, TensorType
from distgraph.spmd.meshslice import (MatmulAxes, block_size, layout_of, slice_choices,
                                      slices_setting)

# A partial GeMM is computed in blocks with a test of the requests in flight between
# them. A block re-reads the whole of the operand it is not cut from, so blocks stay
# large: at least BLOCK_FLOPS each (a few ms of a CPU core), at most MAX_TESTS per GeMM.
# A few tests per GeMM are enough: a started transfer drains through the socket buffers
# by itself, and a test lets MPI feed it and read what arrived.
BLOCK_FLOPS = 2e7
MAX_TESTS = 8


@dataclass(frozen=True)
class LocalMeshSlice:
    """A matmul's MeshSlice on one process: ``dataflow`` on mesh dims ``u`` and ``v``
    (of ``u_size`` and ``v_size`` processes), m split on dim ``m_pos`` of the m-group;
    ``slices`` (K; None while the planner has not chosen it); the sliced letter's global
    ``length`` and its two splits ``parts`` (what K must divide)."""

    dataflow: str
    u: str
    v: str
    u_size: int
    v_size: int
    m_pos: int
    slices: int | None
    length: int
    parts: tuple

    def __str__(self) -> str:
        k = "K chosen by the cost model" if self.slices is None else f"K={self.slices}"
        return f"MeshSlice {self.dataflow} over ({self.u}, {self.v}), {k}"

    def choices(self) -> tuple:
        """The numbers of slices this layout allows."""
        return slice_choices(self.length, *self.parts)

    def block(self, slices: int) -> int:
        return block_size(self.length, *self.parts, slices)


def localize(attrs: dict, site) -> tuple[dict, dict]:
    """The matmul's local attributes and kernel context at ``site``: a
    :class:`LocalMeshSlice` and the process groups along u and v when its layouts are
    MeshSlice's and its ``meshslice`` attribute is set; else a plain local matmul."""
    setting = slices_setting(attrs.get("meshslice"))
    if setting is None:
        return attrs, {}
    found = _layout(attrs, site)
    if found is None:
        return {**attrs, "meshslice": None}, {}
    lay, axes, mesh = found
    local = local_form(lay, axes, site.in_shapes, dict(zip(mesh.dim_names, mesh.shape)),
                       None if setting == "auto" else setting)
    groups = (mesh.group_of(site.process_id, lay.u), mesh.group_of(site.process_id, lay.v))
    return {**attrs, "meshslice": local}, {"groups": groups}


def local_form(layout, axes, in_shapes, sizes: dict, slices=None) -> LocalMeshSlice:
    """The :class:`LocalMeshSlice` of ``layout`` (a :class:`~distgraph.spmd.meshslice.
    SliceLayout`) for a matmul of ``in_shapes`` on mesh dims of ``sizes`` ({name: size}; a
    dim of size 1 is allowed here: one direction then does not communicate)."""
    length, first, second = layout.slicing(axes, in_shapes, sizes)
    return LocalMeshSlice(layout.dataflow, layout.u, layout.v, sizes[layout.u],
                          sizes[layout.v], layout.m_pos, slices, length, (first, second))


def _layout(attrs, site):
    mesh = site.in_attrs[0].mesh
    if site.out_attrs[0].mesh != mesh or site.in_attrs[1].mesh != mesh:
        return None
    lay = layout_of(site.in_attrs[0].spec, site.in_attrs[1].spec, site.out_attrs[0].spec,
                    site.in_shapes, attrs, mesh)
    if lay is None:
        return None
    return lay, MatmulAxes.of(site.in_shapes, attrs), mesh


def collectives(local: LocalMeshSlice, x_local, y_local, out_local, itemsize: int,
                slices: int) -> tuple[tuple, tuple]:
    """One slice's collectives (before its GeMM, after it) as ``(kind, mesh dim, group
    size, buffer bytes)``, from the local shapes of x, y and the result."""
    nx, ny, nout = _size(x_local), _size(y_local), _size(out_local)
    u, v, su, sv = local.u, local.v, local.u_size, local.v_size
    if local.dataflow == "OS":
        return ((("all_gather", v, sv, nx * sv * itemsize // slices),
                 ("all_gather", u, su, ny * su * itemsize // slices)), ())
    if local.dataflow == "LS":
        return ((("all_gather", u, su, ny * su * itemsize // slices),),
                (("reduce_scatter", v, sv, nout * sv * itemsize // slices),))
    return ((("all_gather", v, sv, nx * sv * itemsize // slices),),
            (("reduce_scatter", u, su, nout * su * itemsize // slices),))


def comm(site) -> tuple:
    """The collectives of the matmul's distributed form at ``site``: K partial
    collectives of each kind (K = 1 while the planner has not chosen it)."""
    setting = slices_setting(site.attr("meshslice"))
    if setting is None:
        return ()
    local = localize(dict(site.attrs), site)[0]["meshslice"]
    if local is None:
        return ()
    slices = local.slices or 1
    shapes = [a.local_shape(s) for a, s in zip(site.in_attrs, site.in_shapes)]
    out = site.out_attrs[0].local_shape(site.out_shapes[0])
    before, after = collectives(local, shapes[0], shapes[1], out,
                                dtypes.itemsize(site.in_dtypes[0]), slices)
    return tuple((kind, n, nbytes) for kind, _, n, nbytes in before + after) * slices


def overlap(attrs: dict, ins) -> tuple:
    """One :class:`~distgraph.registry.Overlap` per number of slices the local matmul
    may run with (the one chosen, or every choice while K is open); empty when it does
    not run MeshSlice. ``ins`` are the local TensorTypes of x and y."""
    local = attrs.get("meshslice")
    if not isinstance(local, LocalMeshSlice):
        return ()
    x, y = (tuple(t.shape) for t in ins)
    dtype = ins[0].dtype
    tx, ty = bool(attrs.get("transpose_x")), bool(attrs.get("transpose_y"))
    a = (x[1], x[0]) if tx else x                   # logical A [..., m, k]
    b = (y[1], y[0]) if ty else y                   # logical B [k, n]
    su, sv = local.u_size, local.v_size
    out = _out_local(local, a, b)
    found = []
    for k in ((local.slices,) if local.slices else local.choices()):
        if local.dataflow == "OS":
            ga, gb, gc = a[:-1] + (a[-1] * sv // k,), (b[0] * su // k, b[1]), out
        elif local.dataflow == "LS":
            ga, gb = a, (b[0], b[1] * su // k)
            gc = out[:-1] + (gb[1],)
        else:
            m = local.m_pos
            ga = a[:m] + (a[m] * sv // k,) + a[m + 1:]
            gb, gc = b, ga[:-1] + (b[1],)
        itemsize = dtypes.itemsize(dtype)
        before, after = collectives(local, x, y, out, itemsize, k)
        # every slice reads the operand it does not cut whole (LS: A, RS: B); OS's slices
        # after the first read and write the result again
        again = {"OS": 2 * _size(gc), "LS": _size(ga), "RS": _size(gb)}[local.dataflow]
        found.append(Overlap(k, "matmul", (TensorType(ga, dtype), TensorType(gb, dtype)),
                             (TensorType(gc, dtype),), before, after,
                             reread=again * itemsize * (k - 1) / k))
    return tuple(found)


def _out_local(local, a, b) -> tuple:
    """The local result's shape from the logical local A and B."""
    su, sv = local.u_size, local.v_size
    if local.dataflow == "OS":
        return a[:-1] + (b[1],)
    if local.dataflow == "LS":
        return a[:-1] + (b[1] * su // sv,)
    m = local.m_pos
    return a[:m] + (a[m] * sv // su,) + a[m + 1:-1] + (b[1],)


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- the kernel ---------------------------------------------------------------------------------
def run(ctx, x, y, transpose_x: bool, transpose_y: bool, local: LocalMeshSlice):
    """The local result of the matmul on this process's shards (module docstring)."""
    if local.slices is None:
        raise RuntimeError(f"{local}: the number of slices was never chosen; plan the "
                           "program with dg.passes.plan, which chooses it")
    xp, comm = ctx.xp, ctx.comm
    slices, block = local.slices, local.block(local.slices)
    ranks_u, ranks_v = (ctx.group_ranks(g) for g in ctx.groups)
    a = xp.swapaxes(x, -1, -2) if transpose_x else x
    b = xp.swapaxes(y, -1, -2) if transpose_y else y

    def gather(arr, transposed, axis, k, ranks):
        """Start gathering sub-shard k of a logical operand (``arr``, or ``arr`` with its
        last two axes swapped) along its logical ``axis``: cut and sent as ``arr`` is
        stored, so that no transposed copy is made; :func:`logical` swaps it back."""
        axis = _stored_axis(axis % arr.ndim, arr.ndim, transposed)
        return comm.iall_gather(take_slice(xp, arr, axis, slices, k, block), ranks, axis)

    def logical(values, flags):
        return [xp.swapaxes(v, -1, -2) if t else v for v, t in zip(values, flags)]

    if local.dataflow == "OS":
        out = xp.empty(a.shape[:-1] + (b.shape[1],), dtype=_result_dtype(a, b))

        def start(k):
            return [gather(x, transpose_x, -1, k, ranks_v), gather(y, transpose_y, 0, k, ranks_u)]

        _pipeline(comm, slices, start, lambda k, got, pending: partial_gemm(
            xp, *logical(got, (transpose_x, transpose_y)), out, _poller(pending),
            accumulate=k > 0))
        return out
    if local.dataflow == "LS":
        axis, ranks_out = a.ndim - 1, ranks_v
        out = xp.empty(a.shape[:-1] + (b.shape[1] * local.u_size // local.v_size,),
                       dtype=_result_dtype(a, b))

        def start(k):
            return [gather(y, transpose_y, 1, k, ranks_u)]

        def multiply(k, got, poll):
            return partial_gemm(xp, a, logical(got, (transpose_y,))[0], None, poll)
    else:
        axis, ranks_out = local.m_pos, ranks_u
        shape = list(a.shape[:-1]) + [b.shape[1]]
        shape[axis] = shape[axis] * local.v_size // local.u_size
        out = xp.empty(tuple(shape), dtype=_result_dtype(a, b))

        def start(k):
            return [gather(x, transpose_x, axis, k, ranks_v)]

        def multiply(k, got, poll):
            return partial_gemm(xp, logical(got, (transpose_x,))[0], b, None, poll)

    scatters = []

    def advance(k, got, pending):
        part = multiply(k, got, _poller(pending + scatters))
        scatters.append(comm.ireduce_scatter(part, ranks_out, axis))

    _pipeline(comm, slices, start, advance)
    for k, part in enumerate(comm.wait(scatters)):
        put_slice(xp, out, axis, slices, k, block, part)
    return out


def _stored_axis(axis: int, ndim: int, transposed: bool) -> int:
    """Where a logical operand's ``axis`` (non-negative) lies in its stored array, whose
    last two axes are swapped when ``transposed``."""
    if transposed and axis >= ndim - 2:
        return 2 * ndim - 3 - axis
    return axis


def _pipeline(comm, slices: int, start, advance) -> None:
    """Slice k+1's collectives are started once slice k's are done, then slice k is
    computed (``advance(k, results, slice k+1's requests)``), testing them on the way."""
    pending = start(0)
    for k in range(slices):
        got = comm.wait(pending)
        pending = start(k + 1) if k + 1 < slices else []
        advance(k, got, pending)


def _poller(requests):
    """What a partial GeMM calls between its blocks to move ``requests`` on; None when
    nothing is in flight, so that the GeMM runs in one piece."""
    return (lambda: [r.test() for r in requests]) if requests else None


def _result_dtype(a, b):
    return a.dtype if a.dtype == b.dtype else (a.dtype.type(0) * b.dtype.type(0)).dtype


def partial_gemm(xp, a, b, out, poll, accumulate: bool = False):
    """``a @ b`` over a's leading dims (into ``out`` when given, added to it with
    ``accumulate``), in blocks with ``poll()`` between them, so that requests in flight
    move on: blocks of rows of ``a``, or of columns of ``b`` when ``a`` is the smaller
    operand (each block re-reads the other one); in one block when ``poll`` is None. Each
    block is written where it belongs (no temporary), and on CPUs added by the GeMM
    itself (BLAS's ``C = A B + C``)."""
    rows, inner, cols = _size(a.shape[:-1]), a.shape[-1], b.shape[1]
    a2 = a.reshape(rows, inner)
    target = out.reshape(rows, cols) if out is not None else \
        xp.empty((rows, cols), dtype=_result_dtype(a, b))
    tests = 1 if poll is None else \
        int(max(1, min(MAX_TESTS, 2 * rows * inner * cols // BLOCK_FLOPS)))
    by_rows = rows * inner >= inner * cols
    n = rows if by_rows else cols
    tests = min(tests, n)
    bounds = [n * i // tests for i in range(tests + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        if by_rows:
            _multiply(xp, a2[lo:hi], b, target[lo:hi], accumulate)
        else:
            _multiply(xp, a2, b[:, lo:hi], target[:, lo:hi], accumulate)
        if hi < n:
            poll()
    return out if out is not None else target.reshape(a.shape[:-1] + (cols,))


def _multiply(xp, a, b, into, accumulate: bool) -> None:
    """``into = a @ b``, or ``into += a @ b`` with ``accumulate``: on numpy arrays of one
    BLAS type with ``into`` contiguous, as one GeMM with beta = 1 on the transposes
    (``into^T += b^T a^T`` on Fortran-ordered views, so nothing is copied)."""
    if not accumulate:
        xp.matmul(a, b, out=into)
        return
    fortran = _fortran_operands(xp, a, b, into)
    if fortran is None:
        into += a @ b
        return
    (m1, t1), (m2, t2) = fortran
    gemm = _blas().sgemm if a.dtype.char == "f" else _blas().dgemm
    done = gemm(1.0, m1, m2, beta=1.0, c=into.T, trans_a=t1, trans_b=t2, overwrite_c=True)
    if not xp.shares_memory(done, into):
        raise RuntimeError("BLAS gemm did not accumulate in place")


def _fortran_operands(xp, a, b, into):
    """BLAS's operands (matrix, transposed) of ``into^T += b^T a^T``, each a Fortran-ordered
    view of ``b`` or ``a``; None where BLAS would need a copy (another array library,
    mixed or non-float types, strided blocks)."""
    if xp.__name__ != "numpy" or not into.flags.c_contiguous or \
            not a.dtype == b.dtype == into.dtype or a.dtype.char not in "fd":
        return None
    found = []
    for m in (b, a):          # wanted: m^T; m.T is Fortran-ordered when m is C-ordered
        if m.flags.c_contiguous:
            found.append((m.T, 0))
        elif m.flags.f_contiguous:
            found.append((m, 1))
        else:
            return None
    return found


def _blas():
    from scipy.linalg import blas
    return blas


def take_slice(xp, arr, axis: int, slices: int, k: int, block: int):
    """Sub-shard ``k`` of ``arr`` along ``axis``: every ``slices``-th block of ``block``
    indices, starting with block k, as a contiguous array."""
    axis = axis % arr.ndim
    n = arr.shape[axis]
    grouped = arr.reshape(arr.shape[:axis] + (n // (block * slices), slices, block)
                          + arr.shape[axis + 1:])
    part = grouped[(slice(None),) * (axis + 1) + (k,)]
    return xp.ascontiguousarray(part.reshape(arr.shape[:axis] + (n // slices,)
                                             + arr.shape[axis + 1:]))


def put_slice(xp, out, axis: int, slices: int, k: int, block: int, part) -> None:
    """Write ``part`` into sub-shard ``k`` of ``out`` (contiguous) along ``axis``."""
    n = out.shape[axis]
    grouped = out.reshape(out.shape[:axis] + (n // (block * slices), slices, block)
                          + out.shape[axis + 1:])
    index = (slice(None),) * (axis + 1) + (k,)
    grouped[index] = part.reshape(out.shape[:axis] + (n // (block * slices), block)
                                  + out.shape[axis + 1:])
