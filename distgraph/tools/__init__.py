"""Tools that measure a machine and write what they find into a resource file
(``distgraph cluster calibrate``): they run kernels and collectives, so they sit above the
runtime."""


def __getattr__(name: str):
    # a submodule read as an attribute is imported then, whatever was imported first
    from distgraph import _submodule
    return _submodule(__name__, name)
