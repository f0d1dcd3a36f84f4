"""The compute order of each pipeline stage: the actions (F, B, I, W and COMM's ops) and
the generators of GPipe, 1F1B, interleaved 1F1B and ZB-H1 — pure functions of the pipeline
size P, the micro-batches m and the virtual stages v. schedules.py registers them, adds
the communication and verifies the result."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field


class ScheduleError(ValueError):
    """A schedule that cannot run, or parameters no schedule exists for; says what to change."""


@dataclass(frozen=True)
class Op:
    """One point-to-point operation inside a COMM action."""
    kind: str          # "SEND" | "RECV"
    what: str          # "ACT" (activation, forward) | "GRAD" (gradient, backward)
    mb: int
    chunk: int         # the chunk on *this* rank the data belongs to
    peer: int
    shape: tuple | None = None

    def __str__(self):
        arrow = "to" if self.kind == "SEND" else "from"
        return f"{self.kind}_{self.what}(mb {self.mb}, chunk {self.chunk}, {arrow} {self.peer})"


@dataclass(frozen=True)
class Action:
    kind: str          # "F" | "B" | "I" | "W" | "COMM"
    mb: int = -1
    chunk: int = 0
    ops: tuple = field(default_factory=tuple)

    def __str__(self):
        if self.kind == "COMM":
            return "COMM[" + ", ".join(str(o) for o in self.ops) + "]"
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def F(mb, chunk=0):
    return Action("F", mb, chunk)


def B(mb, chunk=0):
    return Action("B", mb, chunk)


def I(mb, chunk=0):  # noqa: E743 (the paper's name)
    return Action("I", mb, chunk)


def W(mb, chunk=0):
    return Action("W", mb, chunk)


# ---- generators: the compute order of each stage --------------------------------------------

def check_params(P: int, m: int, v: int = 1) -> None:
    if P < 1 or m < 1 or v < 1:
        raise ScheduleError(f"need pipeline size, micro-batches and virtual stages >= 1, got "
                            f"P={P}, m={m}, v={v}")


def gpipe(P: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards (Huang et al. 2019): stash m micro-batches."""
    check_params(P, m)
    return [[F(i) for i in range(m)] + [B(i) for i in range(m)] for _ in range(P)]


def one_f_one_b(P: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush / Megatron): stage s stashes at most min(P - s, m)."""
    check_params(P, m)
    out = []
    for s in range(P):
        warmup = min(P - s - 1, m)                      # phase 1: warm-up forwards
        order = [F(i) for i in range(warmup)]
        for i in range(m - warmup):                     # phase 2: steady, one F then one B
            order += [F(warmup + i), B(i)]
        order += [B(i) for i in range(m - warmup, m)]   # phase 3: cool-down backwards
        out.append(order)
    return out


def interleaved(P: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021): v model chunks per rank; bubble
    (P - 1) / (v m + P - 1). Needs m a multiple of P (micro-batches go through in groups of P)."""
    check_params(P, m, v)
    if v == 1:
        return one_f_one_b(P, m)
    if P == 1:
        raise ScheduleError("interleaving splits the model over the ranks of a pipeline: it "
                            "needs --pp >= 2")
    if m % P:
        raise ScheduleError(f"interleaved schedules run micro-batches in groups of the pipeline "
                            f"size: --micro-batches {m} is not a multiple of --pp {P}; use "
                            f"{-(-m // P) * P}, or --schedule 1f1b")
    total = m * v

    def fwd(k):      # the k-th forward of a stage: (micro-batch, chunk)
        group, within = divmod(k, P * v)
        return group * P + within % P, within // P

    def bwd(k):
        mb, chunk = fwd(k)
        return mb, v - 1 - chunk
    out = []
    for s in range(P):
        warmup = min((P - s - 1) * 2 + (v - 1) * P, total)
        order = [F(*fwd(k)) for k in range(warmup)]
        for k in range(total - warmup):
            order += [F(*fwd(warmup + k)), B(*bwd(k))]
        order += [B(*bwd(k)) for k in range(total - warmup, total)]
        out.append(order)
    return out


def zb_h1(P: int, m: int, costs: dict | None = None) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023): backward split into I (input gradient: on the critical path
    between stages) and W (weight gradient: off it). The order comes from list scheduling over
    the op times ``costs`` ({"F", "I", "W", "send"}; default F = I = W = 1, send 0, the paper's
    assumption): whenever a stage is free it runs I of its next micro-batch if that gradient
    has arrived, else F of the next if fewer than min(P, m) micro-batches are in flight on it
    (1F1B's peak memory, the H1 bound), else its oldest pending W, else it waits for the next
    arrival. Measured with the verifier at unit costs: bubble 0.36x 1F1B's at P=2, m=8, 0.60x
    at P=4, m=16 (the paper's "about a third" is the m >> P limit)."""
    check_params(P, m)
    c = {"F": 1.0, "I": 1.0, "W": 1.0, "send": 0.0, **(costs or {})}
    limit = min(P, m)
    f_end = [[None] * m for _ in range(P)]          # when F(mb) finished on each stage
    i_end = [[None] * m for _ in range(P)]
    nf, ni, live = [0] * P, [0] * P, [0] * P
    pending = [[] for _ in range(P)]                # micro-batches whose W is still to run
    order: list = [[] for _ in range(P)]
    free = [0.0] * P                                # when each stage is next free
    left = [3 * m] * P
    ready = [(0.0, q) for q in range(P)]            # (free, stage) of the unfinished stages:
    # the earliest free first, the lowest stage on a tie (only the stage that acted changes)

    def arrived(t_done, t, local):                  # a result is usable once it got here
        return t_done is not None and t_done + (0.0 if local else c["send"]) <= t + 1e-12
    while ready:
        _, s = heapq.heappop(ready)
        t, j, k = free[s], ni[s], nf[s]
        if j < m and arrived(f_end[s][j], t, True) and (
                s == P - 1 or arrived(i_end[s + 1][j], t, False)):
            order[s].append(I(j))
            i_end[s][j], ni[s] = t + c["I"], j + 1
            pending[s].append(j)
            free[s] = t + c["I"]
        elif k < m and live[s] < limit and (s == 0 or arrived(f_end[s - 1][k], t, False)):
            order[s].append(F(k))
            f_end[s][k], nf[s], live[s] = t + c["F"], k + 1, live[s] + 1
            free[s] = t + c["F"]
        elif pending[s]:
            order[s].append(W(pending[s].pop(0)))
            live[s] -= 1
            free[s] = t + c["W"]
        else:                                       # wait: until the next arrival, or the
            # other stages' next decision (what this stage waits for is not yet scheduled)
            soon = [x + c["send"] for x in (f_end[s - 1][k] if s and k < m else None,
                                             i_end[s + 1][j] if s < P - 1 and j < m else None)
                    if x is not None and x + c["send"] > t]
            soon += [free[q] for q in range(P) if q != s and left[q] and free[q] > t]
            free[s] = min(soon) if soon else t + min(c["F"], c["I"], c["W"])
            heapq.heappush(ready, (free[s], s))
            continue
        left[s] -= 1
        if left[s]:
            heapq.heappush(ready, (free[s], s))
    return order
