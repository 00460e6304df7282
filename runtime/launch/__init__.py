"""Starting and watching a job: the launcher, the mpiexec job, the per-rank bootstrap and
supervisor, and the status files ranks and launcher share."""
