"""Tools that measure a machine and write what they find into a resource file
(``distgraph cluster calibrate``): they run kernels and collectives, so they sit above the
runtime."""
