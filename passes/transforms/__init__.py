"""Program transforms the planner applies around completion: recomputation of
activations, ZeRO-style update sharding."""
