"""Fixtures shared by the test modules."""

import pytest

import distgraph as dg


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype, restoring float32 afterwards."""
    dg.set_default_dtype("float64")
    try:
        yield
    finally:
        dg.set_default_dtype("float32")
