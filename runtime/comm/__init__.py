"""Communicators: the interface (:mod:`.base`), a simulated world of threads
(:mod:`.simulated`), MPI (:mod:`.mpi`: importing it starts MPI) and devices
(:mod:`.device`, :mod:`.nccl`). Import each from its module: this package imports none,
so that a rank's MPI communicator loads only what it uses."""
