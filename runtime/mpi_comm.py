"""The path of milestone 2's MPI communicator; it lives in
:mod:`distgraph.runtime.comm.mpi` (importing it starts MPI)."""

from distgraph.runtime.comm.mpi import MPICommunicator  # noqa: F401
