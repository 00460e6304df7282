"""torch.distributed.pipelining's compute orders (torch 2.x ``schedules.py``), written
here from the algorithms so the schedule tests run without torch: each function returns
{rank: [Action, ...]} with torch's stage numbering (interleaved: stage c on rank c mod
S; ZBV: rank r holds stages r and 2S-1-r). Idle slots (torch's None) are left out: the
unit-cost replay places every action when its inputs and its rank are ready.

- ``one_f_one_b``: Schedule1F1B — rank s runs min(M, S - s) forwards, then alternates a
  backward and a forward, then the remaining backwards.
- ``interleaved``: ScheduleInterleaved1F1B (``zero_bubble=False``) and
  ScheduleInterleavedZeroBubble (``True``): rounds = max(1, M // S) of G = M / rounds
  micro-batches; warm-up forwards (v-1) G + 2 (S-1-r) (zero bubble: + (S-1-r)), capped
  at v M; forward number k runs local chunk (k // G) mod v; backward number k local
  chunk v-1 - ((k - warm-up) // G) mod v; in the steady phase one forward then one
  backward; zero bubble runs input gradients (I) and, from the rank-th backward on, the
  weight gradient (W) of the backward ``rank`` places earlier after each I, the rest at
  the end.
- ``zbv``: ScheduleZBVZeroBubble over n = max(2S-1, M) micro-batches (those >= M
  dropped): 2(S-r)-1 forwards of chunk 0; r pairs (F chunk 1, F chunk 0); S-r triples
  (F, I, W of chunk 1); then steady (F0 I0 W0 F1 I1 W1) until every forward ran; then
  r pairs (I0, I1), S-r pairs (I0, W0), then the W's left of chunk 1, then of chunk 0.
"""

from __future__ import annotations

from collections import defaultdict

from distgraph.plan.schedule import Action


def one_f_one_b(S: int, M: int) -> dict:
    if M < S:
        raise ValueError("Schedule1F1B needs at least as many micro-batches as stages")
    out = {}
    for r in range(S):
        warm = min(M, S - r)
        acts = [Action(r, "F", m) for m in range(warm)]
        f, b = warm, 0
        while b < M:
            acts.append(Action(r, "B", b))
            b += 1
            if f < M:
                acts.append(Action(r, "F", f))
                f += 1
        out[r] = acts
    return out


def gpipe(S: int, M: int) -> dict:
    return {r: [Action(r, "F", m) for m in range(M)] + [Action(r, "B", m) for m in range(M)]
            for r in range(S)}


def interleaved(S: int, v: int, M: int, zero_bubble: bool = False) -> dict:
    rounds = max(1, M // S)
    if M % rounds:
        raise ValueError(f"torch's interleaved schedules need M a multiple of {rounds}")
    per = M // rounds
    back = "I" if zero_bubble else "B"
    out = {}
    for r in range(S):
        warm = min((v - 1) * per + (1 if zero_bubble else 2) * (S - 1 - r), M * v)
        steady = v * M - warm

        def fwd_stage(k, r=r):
            return ((k // per) % v) * S + r

        def bwd_stage(k, r=r, warm=warm):
            return (v - 1 - ((k - warm) // per) % v) * S + r

        count = defaultdict(int)

        def act(stage, kind):
            m = count[(stage, kind)]
            count[(stage, kind)] += 1
            return Action(stage, kind, m)

        acts, backs, weights = [], [], 0
        for k in range(warm + steady + warm):
            if k < warm + steady:
                acts.append(act(fwd_stage(k), "F"))
            if k >= warm:
                acts.append(act(bwd_stage(k), back))
                backs.append(k)
                if zero_bubble and k - warm >= r:
                    acts.append(act(bwd_stage(backs[weights]), "W"))
                    weights += 1
        while zero_bubble and weights < len(backs):
            acts.append(act(bwd_stage(backs[weights]), "W"))
            weights += 1
        out[r] = acts
    return out


def zbv(S: int, M: int) -> dict:
    n = max(2 * S - 1, M)
    out = {}
    for r in range(S):
        c0, c1 = r, 2 * S - 1 - r
        acts = []
        count = defaultdict(int)

        def act(stage, kind):
            m = count[(stage, kind)]
            count[(stage, kind)] += 1
            acts.append(Action(stage, kind, m))

        for _ in range(2 * (S - r) - 1):
            act(c0, "F")
        for _ in range(r):
            act(c1, "F")
            act(c0, "F")
        for _ in range(S - r):
            act(c1, "F")
            act(c1, "I")
            act(c1, "W")
        while count[(c1, "F")] < count[(c0, "F")] or count[(c0, "F")] < n:
            if count[(c0, "F")] < n:
                act(c0, "F")
            act(c0, "I")
            act(c0, "W")
            act(c1, "F")
            act(c1, "I")
            act(c1, "W")
        for _ in range(r):
            act(c0, "I")
            act(c1, "I")
        for _ in range(S - r):
            act(c0, "I")
            act(c0, "W")
        while count[(c1, "W")] < count[(c1, "I")]:
            act(c1, "W")
        while count[(c0, "W")] < count[(c0, "I")]:
            act(c0, "W")
        out[r] = [a for a in acts if a.micro_batch < M]
    return out
