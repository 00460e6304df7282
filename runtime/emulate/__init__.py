"""Emulated clusters: a resource file's machines as network namespaces with shaped
links, faults injected into them, and the same machines as hosts running sshd."""
