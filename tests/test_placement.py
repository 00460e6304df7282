import pytest

from distgraph.errors import ShardingError
from distgraph.mesh import ProcessMesh
from distgraph.placement import DistAttr, Partial, Replicate, Shard, ShardSpec

MESH = ProcessMesh([[0, 1, 2], [3, 4, 5]], ["x", "y"])


def test_normalisation_and_str():
    spec = ShardSpec(["x", ("y",), []], partial=[])
    assert spec.dims == ("x", "y", None)
    assert spec.partial == frozenset()
    assert str(ShardSpec(["x", None], partial={"y"})) == "[x, None] P(y)"
    assert str(ShardSpec([("x", "y"), None])) == "[(x,y), None]"
    assert str(ShardSpec([None], "y")) == "[None] P(y)"
    assert ShardSpec(["x", None]) == ShardSpec(("x", None), ())
    assert hash(ShardSpec([["x", "y"]])) == hash(ShardSpec([("x", "y")]))
    with pytest.raises(Exception):
        ShardSpec(["x"]).dims = ()


def test_mesh_dims_and_lookup():
    spec = ShardSpec([("y", "x"), None, "z"], partial={"w"})
    assert spec.mesh_dims() == ("y", "x", "z", "w")
    assert spec.entry(0) == ("y", "x") and spec.entry(1) == ()
    assert spec.tensor_dim_of("x") == 0 and spec.tensor_dim_of("w") is None
    assert ShardSpec.replicated(3) == ShardSpec([None, None, None])


@pytest.mark.parametrize("dims", [3, "x", [3], [("x", 1)], [""]])
def test_malformed_specs(dims):
    with pytest.raises(ShardingError):
        ShardSpec(dims)


@pytest.mark.parametrize("spec, shape, message", [
    (ShardSpec(["x"]), (4, 6), "1 entries for a 2-d tensor"),
    (ShardSpec(["q", None]), (4, 6), "unknown mesh dim 'q'"),
    (ShardSpec(["x", "x"]), (4, 6), "'x' is used twice"),
    (ShardSpec([("y", "y"), None]), (4, 6), "'y' is used twice"),
    (ShardSpec(["x", None], partial={"x"}), (4, 6), "'x' is used twice"),
    (ShardSpec([None, "y"]), (4, 5), "dim 1 of size 5 is not divisible by 3"),
    (ShardSpec([("x", "y"), None]), (3, 6), "dim 0 of size 3 is not divisible by 6"),
])
def test_validate_errors_name_everything(spec, shape, message):
    with pytest.raises(ShardingError, match=message) as info:
        spec.validate(MESH, shape, "fc1.weight")
    text = str(info.value)
    assert "fc1.weight" in text and str(list(shape)) in text
    assert str(spec) in text and str(MESH) in text


def test_placements_round_trip():
    spec = ShardSpec.from_placements([Shard(1), Partial()], MESH, 2)
    assert spec == ShardSpec([None, "x"], partial={"y"})
    assert spec.to_placements(MESH) == (Shard(1), Partial())
    both = ShardSpec.from_placements([Shard(-1), Shard(1)], MESH, 2)
    assert both == ShardSpec([None, ("x", "y")])  # mesh dim order: x major
    assert both.to_placements(MESH) == (Shard(1), Shard(1))
    assert ShardSpec([None]).to_placements(MESH) == (Replicate(), Replicate())
    assert [str(p) for p in (Shard(0), Replicate(), Partial())] == ["S(0)", "R", "P"]


def test_placements_errors():
    with pytest.raises(ShardingError, match="one placement per mesh dim"):
        ShardSpec.from_placements([Shard(0)], MESH, 2)
    with pytest.raises(ShardingError, match="no dim 2"):
        ShardSpec.from_placements([Shard(2), Replicate()], MESH, 2)
    with pytest.raises(ShardingError, match="not in mesh dim order"):
        ShardSpec([("y", "x")]).to_placements(MESH)


def test_dist_attr_local_shape_and_slices():
    attr = DistAttr(MESH, ShardSpec([("x", "y"), None]))
    assert attr.local_shape((12, 5)) == (2, 5)
    # (x, y) is major-first: block index = cx * 3 + cy
    assert attr.local_slices((12, 5), 4) == (slice(8, 10), slice(0, 5))
    attr = DistAttr(MESH, ShardSpec([("y", "x"), None]))
    assert attr.local_slices((12, 5), 4) == (slice(6, 8), slice(0, 5))  # 1 * 2 + 1
    attr = DistAttr(MESH, ["y", None])
    assert attr.spec == ShardSpec(["y", None])
    assert attr.local_slices((6, 2), 5) == (slice(4, 6), slice(0, 2))
    assert str(attr) == f"[y, None] on {MESH}"
    assert hash(attr) == hash(DistAttr(MESH, ShardSpec(["y", None])))


def test_dist_attr_validates_against_mesh():
    with pytest.raises(ShardingError, match="unknown mesh dim 'z'"):
        DistAttr(MESH, ShardSpec(["z"]))
    with pytest.raises(ShardingError, match="not divisible"):
        DistAttr(MESH, ShardSpec(["x"])).local_shape((3,))


@pytest.mark.parametrize("dims,partial", [
    (["x", None], ()), (("x", None), frozenset({"y"})), ([None, "y"], ["x"]), ([], ()),
    (["x", None], "y"), ([("x", "y"), None], ()), ([["x"], None], set()), (["x", []], ("y",)),
])
def test_the_plain_form_constructs_the_spec_the_general_path_does(dims, partial):
    """Entries that are None or names (and partial names) are stored as given; the same
    spec the normalising path makes from the same entries in any other form."""
    spec = ShardSpec(dims, partial)
    general = ShardSpec(iter(dims), partial if not isinstance(partial, (str,)) else [partial])
    assert spec == general and hash(spec) == hash(general) and str(spec) == str(general)
    assert type(spec.dims) is tuple and type(spec.partial) is frozenset


@pytest.mark.parametrize("dims", [["", None], [None, 3], [("x", ""), None]])
def test_malformed_entries_fail_on_the_plain_form_too(dims):
    with pytest.raises(ShardingError):
        ShardSpec(dims)
    with pytest.raises(ShardingError):
        ShardSpec(["x"], partial=[""])


def test_a_spec_checked_on_one_mesh_is_checked_again_on_another():
    """A spec remembers only the dim names it passed on: on a mesh of other names, or
    after failing, it is checked again (and fails each time)."""
    spec = ShardSpec(["x", "y"])
    spec.validate_mesh(MESH)
    spec.validate_mesh(MESH)
    other = ProcessMesh([0, 1], ["x"])
    for _ in range(2):
        with pytest.raises(ShardingError, match="unknown mesh dim 'y'"):
            spec.validate_mesh(other)
        with pytest.raises(ShardingError, match="unknown mesh dim 'y'"):
            DistAttr(other, spec)
    twice = ShardSpec(["x", "x"])
    for _ in range(2):
        with pytest.raises(ShardingError, match="used twice"):
            twice.validate_mesh(MESH)
    assert spec.mesh_dims() == ("x", "y") and ShardSpec([None], "y").mesh_dims() == ("y",)


def test_a_spec_valid_for_one_shape_is_checked_again_for_another():
    """validate remembers only the (dim names, mesh sizes, shape) it last passed on."""
    spec = ShardSpec([None, "y"])
    spec.validate(MESH, (4, 6))
    spec.validate(MESH, (4, 6))
    for _ in range(2):
        with pytest.raises(ShardingError, match="dim 1 of size 5 is not divisible by 3"):
            spec.validate(MESH, (4, 5))
        with pytest.raises(ShardingError, match="not divisible by 4"):
            spec.validate(ProcessMesh([[0, 1, 2, 3]], ["x", "y"]), (4, 6))
        with pytest.raises(ShardingError, match="1 entries for a 2-d tensor|2 entries"):
            spec.validate(MESH, (6,))
    spec.validate(MESH, (4, 6))
