"""Emulated clusters: a resource file's machines as network namespaces with shaped
links, and faults injected into them."""
