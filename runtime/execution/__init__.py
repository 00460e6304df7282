"""Running a Plan on this process: kernels, reshard steps, the actors of the task
graph, the timeline."""
