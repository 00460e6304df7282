import pickle

import numpy as np
import pytest

from distgraph.errors import ShardingError
from distgraph.mesh import ProcessMesh


@pytest.fixture
def mesh():
    return ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["dp", "mp"])


def test_properties(mesh):
    assert mesh.shape == (2, 3)
    assert mesh.ndim == 2
    assert mesh.size == 6
    assert mesh.dim_names == ("dp", "mp")
    assert mesh.process_ids == [0, 1, 2, 3, 4, 5]
    assert mesh.dim_size("mp") == 3
    assert mesh.coord(4) == (1, 1)
    assert 5 in mesh and 6 not in mesh and "a" not in mesh


def test_default_names_and_ndarray_input():
    m = ProcessMesh(np.array([[7, 3], [1, 0]]))
    assert m.dim_names == ("d0", "d1")
    assert m.process_ids == [7, 3, 1, 0]
    assert m.coord(1) == (1, 0)


def test_mesh_is_a_read_only_copy(mesh):
    arr = mesh.mesh
    assert arr.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError):
        arr[0, 0] = 9
    with pytest.raises(AttributeError):
        mesh.foo = 1


def test_getitem(mesh):
    assert mesh[1] == ProcessMesh([3, 4, 5], ["mp"])
    assert mesh[:, 2] == ProcessMesh([2, 5], ["dp"])
    assert mesh[:, 1:] == ProcessMesh([[1, 2], [4, 5]], ["dp", "mp"])
    with pytest.raises(ShardingError, match="single process"):
        mesh[1, 2]
    with pytest.raises(ShardingError, match="out of range"):
        mesh[5]


def test_get_mesh_with_dim(mesh):
    assert mesh.get_mesh_with_dim("mp") == ProcessMesh([[0, 3], [1, 4], [2, 5]], ["mp", "dp"])
    assert mesh.get_mesh_with_dim("mp", 1) == ProcessMesh([1, 4], ["dp"])
    assert mesh.get_mesh_with_dim("dp", 0) == ProcessMesh([0, 1, 2], ["mp"])


def test_reshape(mesh):
    m = mesh.reshape([3, 2], ["a", "b"])
    assert m.process_ids == mesh.process_ids and m.shape == (3, 2)
    assert mesh.reshape([6]).dim_names == ("d0",)
    with pytest.raises(ShardingError, match="cannot reshape"):
        mesh.reshape([4])


def test_groups(mesh):
    assert mesh.groups("dp") == [(0, 3), (1, 4), (2, 5)]
    assert mesh.groups("mp") == [(0, 1, 2), (3, 4, 5)]
    assert mesh.group_of(4, "dp") == (1, 4)
    m3 = ProcessMesh(np.arange(8).reshape(2, 2, 2), ["x", "y", "z"])
    assert m3.groups("y") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    with pytest.raises(ShardingError, match="has no dim 'q'"):
        mesh.groups("q")


def test_contains_mesh(mesh):
    assert mesh.contains_mesh(ProcessMesh([5, 0]))
    assert not mesh.contains_mesh(ProcessMesh([5, 6]))


def test_equality_hash_and_pickle(mesh):
    same = ProcessMesh([[0, 1, 2], [3, 4, 5]], ["dp", "mp"])
    assert mesh == same and hash(mesh) == hash(same)
    assert mesh != ProcessMesh([[0, 1, 2], [3, 4, 5]], ["a", "b"])
    assert mesh != mesh.reshape([3, 2], ["dp", "mp"])
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert len({mesh, same}) == 1


def test_str(mesh):
    assert str(ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])) == \
        "ProcessMesh([[0, 1], [2, 3]], dims=[dp, mp])"
    assert eval(repr(mesh), {"ProcessMesh": ProcessMesh}) == mesh


@pytest.mark.parametrize("ids, names, message", [
    ([[0, 1], [1, 2]], None, "duplicate process ids \\[1\\]"),
    ([0, -1], None, "negative"),
    ([0, 1.5], None, "not an int"),
    ([True, 2], None, "not an int"),
    ([], None, "empty"),
    ([[0, 1], [2]], None, "rectangular"),
    (3, None, "at least one dim"),
    ([[0, 1], [2, 3]], ["x"], "2 dim names for a 1-d|1 dim names for a 2-d"),
    ([[0, 1], [2, 3]], ["x", "x"], "duplicated dim names"),
])
def test_invalid_meshes(ids, names, message):
    with pytest.raises(ShardingError, match=message) as info:
        ProcessMesh(ids, names)
    assert "ProcessMesh(" in str(info.value)


class _Id(int):
    """An Integral id that is not an int: the mesh checks it one by one."""


@pytest.mark.parametrize("seed", range(6))
def test_checked_at_once_as_one_by_one(seed):
    """Ids of int types are checked and laid out with numpy at once; ids of other
    Integral types go the checks one by one: both make the same mesh, each coordinate
    the row-major index of its id, and both refuse duplicates and negative ids alike."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 5, size=int(rng.integers(1, 4))))
    ids = rng.permutation(4 * int(np.prod(shape)))[:int(np.prod(shape))].reshape(shape)
    fast = ProcessMesh(ids.tolist())
    plain = ProcessMesh(np.vectorize(_Id, otypes=[object])(ids))
    assert fast == plain and fast.process_ids == plain.process_ids
    for index in np.ndindex(*shape):
        pid = int(ids[index])
        assert fast.coord(pid) == plain.coord(pid) == tuple(int(i) for i in index)
    for bad, message in ((-ids - 1, "negative"), (np.zeros_like(ids) + 7, "duplicate")):
        if bad.size == 1 and message == "duplicate":
            continue
        for given in (bad.tolist(), bad, np.vectorize(_Id, otypes=[object])(bad)):
            with pytest.raises(ShardingError, match=message):
                ProcessMesh(given)
