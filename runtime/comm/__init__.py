"""Communicators: the interface (:mod:`.base`), a simulated world of threads
(:mod:`.simulated`) and MPI (:mod:`.mpi`, imported only when used: importing it starts
MPI)."""

from distgraph.runtime.comm.base import MAX_TAG, Communicator, Request, default_timeout
from distgraph.runtime.comm.simulated import SimulatedWorld
