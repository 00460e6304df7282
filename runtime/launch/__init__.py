"""Starting and watching a job: the launcher, the mpiexec job, the per-rank bootstrap and
supervisor, the status files ranks and launcher share, and for jobs over several hosts
the placement of ranks on hosts, reaching the hosts, and what runs on each of them."""
