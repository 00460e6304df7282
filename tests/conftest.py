"""Fixtures shared by the test modules."""

import pytest

import distgraph as dg


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype, restoring the one before afterwards."""
    before = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        yield
    finally:
        dg.set_default_dtype(before)


@pytest.fixture(autouse=True)
def _default_dtype_restored():
    """Each test starts from the default dtype the one before it found (a bench helper
    that plans in bfloat16 sets it for its caller and leaves it set)."""
    before = dg.get_default_dtype()
    try:
        yield
    finally:
        dg.set_default_dtype(before)
