"""What a plan was made for, in a few hundred bytes: the program, the cluster.

A plan file (:mod:`distgraph.plan.file`) keeps these prints beside its decisions, and a
file is used only where the prints of the program and the cluster at hand equal them.
A print is plain data (JSON-ready) with a digest of the whole and the few figures a
person recognises, so that the first difference can be named in words
(:func:`program_difference`, :func:`cluster_difference`):

- program: the number of blocks (layers), the feeds and the parameters (name, shape,
  dtype), the number of ops, a digest per layer of its ops (type, role, the shapes and
  dtypes of their operands and results) and one of everything;
- cluster: its name, its devices (how many of each type, model and memory) and a digest
  of the resource data (devices, figures, links, meshes; not the name), or None for a
  plan made without a cluster.

Example::

    saved = program_print(built)
    program_difference(saved, program_print(other))
    # 'the plan was made for 24 layers; the model has 25'
"""

from __future__ import annotations

import hashlib
import json


def program_print(built) -> dict:
    """The print of ``built`` (a BuiltProgram, before any planning)."""
    program = built.program
    values = program.values
    layers: dict = {}
    whole = hashlib.sha256()
    for op in program.ops:
        line = "|".join((op.type, str(op.role), _shapes(op.inputs), _shapes(op.outputs)))
        layer = op.layer or ""
        digest = layers.get(layer)
        if digest is None:
            digest = layers[layer] = hashlib.sha256()
        digest.update(line.encode())
        whole.update(f"{layer}:{line}\n".encode())
    return {"mode": built.mode,
            "layers": len(built.block_paths),
            "feeds": [[n, list(values[n].shape), values[n].dtype] for n in built.feed_names],
            "parameters": [[v.name, list(v.shape), v.dtype] for v in program.parameters],
            "ops": len(program.ops),
            "layer_digests": {k: d.hexdigest()[:16] for k, d in layers.items()},
            "digest": whole.hexdigest()}


def _shapes(values) -> str:
    return ",".join(f"{v.dtype}{list(v.shape)}" for v in values)


def program_difference(saved: dict, got: dict) -> str | None:
    """The first difference between the print a plan was made for (``saved``) and the
    program's (``got``), in words; None where they are equal."""
    if saved["mode"] != got["mode"]:
        return (f"the plan was made for a {saved['mode']} program; this is a {got['mode']} "
                f"program")
    if saved["layers"] != got["layers"]:
        return (f"the plan was made for {saved['layers']} layers; the model has "
                f"{got['layers']}")
    said = _listed(saved["feeds"], got["feeds"], "input")
    if said:
        return said
    said = _listed(saved["parameters"], got["parameters"], "parameter")
    if said:
        return said
    if saved["ops"] != got["ops"]:
        return (f"the plan was made for a program of {saved['ops']} ops; this one has "
                f"{got['ops']}")
    if saved["digest"] != got["digest"]:
        theirs = got["layer_digests"]
        for layer, digest in saved["layer_digests"].items():
            if theirs.get(layer) != digest:
                return (f"the ops of layer {layer or '(top level)'!r} differ from those the "
                        f"plan was made for (their types, roles, shapes or dtypes)")
        return "the program's ops differ from those the plan was made for"
    return None


def _listed(saved: list, got: list, what: str) -> str | None:
    """The first (name, shape, dtype) entry that differs, in words."""
    for k, (mine, theirs) in enumerate(zip(saved, got)):
        if list(mine) != list(theirs):
            if mine[0] != theirs[0]:
                return (f"the plan was made for {what} #{k} {mine[0]!r}; the program's "
                        f"{what} #{k} is {theirs[0]!r}")
            return (f"the plan was made for {what} {mine[0]!r} of shape {mine[1]} "
                    f"{mine[2]}; the program's is {theirs[1]} {theirs[2]}")
    if len(saved) != len(got):
        extra = got[len(saved)] if len(got) > len(saved) else saved[len(got)]
        return (f"the plan was made for {len(saved)} {what}s; the program has {len(got)} "
                f"({extra[0]!r} is in one only)")
    return None


def cluster_print(cluster) -> dict | None:
    """The print of ``cluster`` (a Cluster; None: a plan made without one)."""
    if cluster is None:
        return None
    kinds: dict = {}
    for d in cluster.devices:
        key = (d.type, d.model, float(d.memory))
        kinds[key] = kinds.get(key, 0) + 1
    data = dict(cluster.to_dict(compact=True))
    data.pop("name", None)          # a renamed file is the same machine
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    return {"name": cluster.name, "devices": len(cluster.devices),
            "kinds": [[t, m, mem, n] for (t, m, mem), n in kinds.items()],
            "digest": digest}


def describe_cluster(found: dict | None) -> str:
    """``found`` (a cluster print) in words: "cluster 'local4' (4 CPU cpu of 4 GB)"."""
    if found is None:
        return "no cluster"
    kinds = ", ".join(f"{n} {t} {m} of {mem:g} GB" for t, m, mem, n in found["kinds"])
    return f"cluster {found['name']!r} ({kinds})"


def cluster_difference(saved: dict | None, got: dict | None) -> str | None:
    """The first difference between the cluster a plan was made for and ``got``, in
    words; None where they are the same machine."""
    if saved is None and got is None:
        return None
    if saved is None or got is None:
        return (f"the plan was made for {describe_cluster(saved)}; it is used with "
                f"{describe_cluster(got)}")
    if saved["devices"] != got["devices"]:
        return (f"the plan was made for {saved['devices']} devices "
                f"({describe_cluster(saved)}); the cluster has {got['devices']} "
                f"({describe_cluster(got)})")
    if sorted(map(tuple, saved["kinds"])) != sorted(map(tuple, got["kinds"])):
        return (f"the plan was made for {describe_cluster(saved)}; the cluster is "
                f"{describe_cluster(got)}")
    if saved["digest"] != got["digest"]:
        return (f"the plan was made for {describe_cluster(saved)}; the cluster "
                f"{got['name']!r} has the same devices but other figures or links (its "
                f"resource data differ)")
    return None
