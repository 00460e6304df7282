"""One process's local program: what the partition pass gives for it.

Example::

    local = plan.local(1)
    print(local.pretty())          # its ops on local shapes, with its reshard points
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distgraph.ir import Program
from distgraph.plan.kinds import StepKind, collective_bytes


@dataclass
class LocalProgram:
    """What one process runs: ``program`` on local shapes, ``comm_points[i]`` (reshard
    points) before its op i (``len(ops)``: after the last), ``op_context`` for kernels
    that need it (op index -> KernelContext fields), ``op_comm`` the collectives inside
    ops' distributed forms (op index -> ((kind, n, bytes), ...))."""

    process_id: int
    program: Program
    comm_points: dict = field(default_factory=dict)
    op_context: dict = field(default_factory=dict)
    op_comm: dict = field(default_factory=dict)

    def points(self) -> list:
        return [p for i in sorted(self.comm_points) for p in self.comm_points[i]]

    def bytes_sent(self) -> dict:
        """Bytes this process sends per step by kind: the reshard steps, and the
        collectives inside ops' distributed forms."""
        sent: dict = {}
        for point in self.points():
            for step in point.steps:
                b = step.bytes_sent_by(self.process_id)
                if b:
                    sent[step.kind] = sent.get(step.kind, 0.0) + b
        for collectives in self.op_comm.values():
            for kind, n, nbytes in collectives:
                kind = StepKind.parse(kind)       # all_to_allv counts as all_to_all
                sent[kind] = sent.get(kind, 0.0) + float(collective_bytes(kind, n, nbytes))
        return sent

    def op_groups(self):
        """(op index, process group) for every group an op communicates in inside its
        kernel (its context's ``group`` or ``groups``)."""
        for index, ctx in self.op_context.items():
            groups = ctx.get("groups") or ((ctx["group"],) if ctx.get("group") else ())
            for members in groups:
                yield index, tuple(members)

    def pretty(self) -> str:
        lines = [f"process {self.process_id}: {len(self.program.ops)} ops, "
                 f"{len(self.points())} reshard points"]
        for i, op in enumerate(self.program.ops + [None]):
            for p in self.comm_points.get(i, ()):
                lines.append(f"  {p}")
            if op is not None:
                ins = ", ".join(v.type_str() for v in op.inputs)
                outs = ", ".join(v.type_str() for v in op.outputs)
                lines.append(f"  {op.type}({ins}) -> {outs}")
        return "\n".join(lines)
