"""Pipeline schedules as data, and the verifier that proves one safe before it runs.

A schedule is, for each of the P stages (ranks), an ordered list of actions:

    F(mb, c)   forward of micro-batch mb through this rank's model chunk c
    B(mb, c)   its backward;  or the zero-bubble halves  I(mb, c) (input gradient) and
    W(mb, c)   (weight gradient)
    COMM(ops)  point-to-point operations posted together and completed together: each op is
               (SEND or RECV, ACT or GRAD, mb, c, peer)

The rest of this design: docs/pipeline-parallel.md, "hpcdist/parallel/schedules.py"."""
from __future__ import annotations

from dataclasses import dataclass



from .orders import (B, F, I, W, Action, Op, ScheduleError, check_params,  # noqa: F401
                     gpipe, interleaved, one_f_one_b, zb_h1)


@dataclass(frozen=True)
class Schedule:
    """A schedule as the registry keeps it: the executor calls these and never its name.

    ``generate(P, m, v, costs)``: the compute order per stage (communication is added by
    ``make``); ``stash(P, m, v)``: the most micro-batch chunks each stage may hold, which the
    verifier enforces; ``replan``: whether the plan depends on measured op times (the
    executor measures F, I and W for ``replan_after`` steps, agrees on their means over the
    pipeline, and generates again); ``virtual``: needs (True) or refuses (False) v > 1.
    What the planner reads (plan/): ``makespan(P, m, v, f, b)``, the step's length in
    compute units for uniform per-chunk forward f and backward b (None: the simulator
    walks the schedule instead), and ``plan_v``, the virtual-stage counts it tries."""
    name: str
    generate: object
    stash: object
    virtual: bool = False
    replan: bool = False
    replan_after: int = 2
    about: str = ""
    makespan: object = None
    plan_v: tuple = (1,)


REGISTRY: dict = {}


def register(schedule: Schedule) -> Schedule:
    """Add a schedule (a new one is a generator and a stash bound, no executor change)."""
    REGISTRY[schedule.name] = schedule
    return schedule


def _flush(P, m, v, f, b):
    """GPipe, 1F1B and interleaved for uniform costs: (mv + P - 1)(f + b) with per-chunk
    costs (the bubble (P - 1)/(mv + P - 1))."""
    return (m * v + P - 1) * (f + b)


register(Schedule("gpipe", lambda P, m, v, costs: gpipe(P, m), lambda P, m, v: [m * v] * P,
                  makespan=_flush, about="all forwards, then all backwards (Huang et al.)"))
register(Schedule("1f1b", lambda P, m, v, costs: one_f_one_b(P, m),
                  lambda P, m, v: [min(P - s, m) for s in range(P)], makespan=_flush,
                  about="one forward, one backward after warm-up (PipeDream-Flush)"))
register(Schedule("interleaved", lambda P, m, v, costs: interleaved(P, m, v),
                  lambda P, m, v: [min((P - s - 1) * 2 + (v - 1) * P + 1, m * v)
                                   for s in range(P)],
                  virtual=True, makespan=_flush, plan_v=(2, 4),
                  about="1F1B over v chunks per rank (Megatron-LM)"))
register(Schedule("zb-h1", lambda P, m, v, costs: zb_h1(P, m, costs),
                  # 1F1B's peak on every stage (inputs are kept until W)
                  lambda P, m, v: [min(P, m)] * P, replan=True,
                  # Qi et al.: the bubble (P - 1)(T_F + T_I - T_W), with I = W = b/2
                  makespan=lambda P, m, v, f, b: m * (f + b) + (P - 1) * f,
                  about="zero bubble: B split into I and W, W fills the bubble (Qi et al.)"))

def __getattr__(name):
    """``SCHEDULES``: the registered names, now (a schedule registered later is in it)."""
    if name == "SCHEDULES":
        return tuple(REGISTRY)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(name: str) -> Schedule:
    if name not in REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def check(name: str, v: int = 1) -> Schedule:
    """The registered schedule ``name``, refused (ScheduleError) where ``v`` does not suit it."""
    schedule = get(name)
    if v > 1 and not schedule.virtual:
        virtual = [n for n, r in REGISTRY.items() if r.virtual]
        raise ScheduleError(f"--virtual-stages {v} needs --schedule {' or '.join(virtual)}")
    if schedule.virtual and v == 1:
        raise ScheduleError(f"--schedule {name} needs --virtual-stages >= 2")
    return schedule


def make(name: str, P: int, m: int, v: int = 1, costs: dict | None = None) -> list[list[Action]]:
    """Compute order for the registered schedule ``name``, with communication added.
    ``costs``: op times a replanning schedule plans with (the others do not depend on them)."""
    schedule = check(name, v)
    return add_communication(schedule.generate(P, m, v, costs), P, v)


def promised_stash(name: str, P: int, m: int, v: int = 1) -> list[int]:
    """Most micro-batch chunks each stage holds activations for (F done, W or B not yet)."""
    return get(name).stash(P, m, v)


def partition(n_layer: int, parts: int, split: list | None = None) -> list[tuple[int, int]]:
    """[lo, hi) of the blocks in each of ``parts`` virtual stages: as even as possible (the
    first stages take one more), or the sizes ``split`` gives. With fewer blocks than stages
    the first and the last stage may hold none: they still embed and hold the head."""
    if split:
        if len(split) != parts or any(n < 0 for n in split) or sum(split) != n_layer:
            raise ValueError(f"--pp-split {','.join(map(str, split))} must give {parts} "
                             f"sizes (>= 0) adding up to n_layer ({n_layer})")
        sizes = list(split)
    elif n_layer >= parts:
        sizes = [n_layer // parts + (i < n_layer % parts) for i in range(parts)]
    else:   # fewer blocks than stages: the middle ones get a block each, the first (which
        # embeds) and the last (which holds the head) may hold none
        if n_layer < parts - 2:
            raise ValueError(f"n_layer ({n_layer}) is too small for pp x virtual stages "
                             f"({parts}): every stage but the first and the last needs a "
                             f"block; use at most {n_layer + 2} stages")
        sizes = [0] + [1] * (parts - 2) + [0]
        for i in range(n_layer - (parts - 2)):      # what is left: the first, then the last
            sizes[0 if i == 0 else -1] += 1
    bounds, lo = [], 0                       # [lo, hi) of each stage's blocks
    for n in sizes:
        bounds.append((lo, lo + n))
        lo += n
    return bounds



# ---- communication --------------------------------------------------------------------------

def add_communication(order: list[list[Action]], P: int, v: int = 1) -> list[list[Action]]:
    """Insert the sends and receives; group those between two computes into one COMM."""
    K = P * v                                             # virtual stages
    out = []
    for s, actions in enumerate(order):
        stage, pending = [], []

        def flush():
            if pending:
                stage.append(Action("COMM", ops=tuple(pending)))
                pending.clear()
        for a in actions:
            k = a.chunk * P + s                           # this action's virtual stage
            if a.kind == "F" and k > 0:
                pending.append(Op("RECV", "ACT", a.mb, a.chunk, (s - 1) % P))
            if a.kind in ("B", "I") and k < K - 1:
                pending.append(Op("RECV", "GRAD", a.mb, a.chunk, (s + 1) % P))
            flush()
            stage.append(a)
            if a.kind == "F" and k < K - 1:
                pending.append(Op("SEND", "ACT", a.mb, a.chunk, (s + 1) % P))
            if a.kind in ("B", "I") and k > 0:
                pending.append(Op("SEND", "GRAD", a.mb, a.chunk, (s - 1) % P))
        flush()
        out.append(stage)
    return out


def message_key(op: Op, rank: int, P: int, v: int = 1):
    """What a send and its receive share: (source, destination, what, mb, virtual stage of the
    data's producer) — the tag the executor uses, and how the verifier pairs them."""
    if op.kind == "SEND":
        src, dst, k = rank, op.peer, op.chunk * P + rank
    else:
        src, dst = op.peer, rank
        # the producer is the previous virtual stage for activations, the next for gradients
        k = op.chunk * P + rank + (-1 if op.what == "ACT" else 1)
    return (src, dst, op.what, op.mb, k)


# ---- the verifier ---------------------------------------------------------------------------

@dataclass
class Verdict:
    makespan: float
    bubble: float                 # idle share of stage-time
    peak_stash: list
    busy: list
    events: list                  # per stage: (kind, mb, chunk, start, end) of each compute


def verify(schedule: list[list[Action]], P: int, m: int, v: int = 1, costs=None,
           stash_limit: list | None = None) -> Verdict:
    """Run every stage's actions under strict MPI semantics; raise ScheduleError unless the
    schedule finishes correctly. ``costs``: {"F", "B", "I", "W", "send"} times (default F 1,
    B 2, I 1, W 1, send 0); a value may be a list, one time per stage."""
    c = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "send": 0.0, **(costs or {})}
    if len(schedule) != P:
        raise ScheduleError(f"the schedule has {len(schedule)} stages, the pipeline {P}")
    _check_compute(schedule, P, m, v)
    idx = [0] * P
    clock = [0.0] * P
    busy = [0.0] * P
    posted: dict = {}                 # key -> list of (kind, stage, time) waiting to be matched
    matched: dict = {}                # (stage, action index, op index) -> completion time
    peak = [0] * P
    live: list = [set() for _ in range(P)]
    post_time: dict = {}
    sends = [[] for _ in range(P)]    # this stage's posted sends (action, op index)
    got = [set() for _ in range(P)]   # (what, mb, chunk) received so far
    events: list = [[] for _ in range(P)]
    progress = True
    while progress:
        progress = False
        for s in range(P):
            while idx[s] < len(schedule[s]):
                a = schedule[s][idx[s]]
                if a.kind == "COMM":
                    key0 = (s, idx[s])
                    if key0 not in post_time:      # post every op of the batch now
                        post_time[key0] = clock[s]
                        for j, op in enumerate(a.ops):
                            _post(posted, matched, message_key(op, s, P, v), op, s, idx[s], j=j,
                                  t=clock[s], send_cost=c["send"])
                        progress = True
                    # receives block; sends are posted and complete when their receive is
                    # posted, waited for at the end of the step (below)
                    done = [matched.get((s, idx[s], j)) for j, op in enumerate(a.ops)
                            if op.kind == "RECV"]
                    if any(t is None for t in done):
                        break                       # blocked until the peers send
                    clock[s] = max([clock[s]] + done)
                    sends[s] += [(idx[s], j) for j, op in enumerate(a.ops) if op.kind == "SEND"]
                    got[s].update((op.what, op.mb, op.chunk) for op in a.ops if op.kind == "RECV")
                else:
                    _compute(a, s, idx[s], P, v, c, got=got[s], events=events[s], clock=clock,
                             busy=busy, live=live[s], peak=peak)
                idx[s] += 1
                progress = True
    _check_end(schedule, P, idx, posted, matched, sends, clock=clock, peak=peak, limit=stash_limit)
    makespan = max(clock)
    bubble = 1.0 - sum(busy) / (P * makespan) if makespan else 0.0
    return Verdict(makespan, bubble, peak, busy, events)


def _compute(a, s, i, P, v, c, *, got, events, clock, busy, live, peak) -> None:
    """Stage s runs compute action ``a`` (its ``i``-th): its input must have arrived; the
    clock, busy time, events and the stash of live micro-batches move on."""
    k = a.chunk * P + s                 # the data this compute needs is here
    need = ("ACT" if a.kind == "F" and k > 0 else
            "GRAD" if a.kind in ("B", "I") and k < P * v - 1 else None)
    if need and (need, a.mb, a.chunk) not in got:
        raise ScheduleError(f"stage {s}: action {i} {a} runs before its "
                            f"{'activation' if need == 'ACT' else 'gradient'} is received")
    cost = c[a.kind][s] if isinstance(c[a.kind], (list, tuple)) else c[a.kind]
    events.append((a.kind, a.mb, a.chunk, clock[s], clock[s] + cost))
    clock[s] += cost
    busy[s] += cost
    key = (a.mb, a.chunk)
    if a.kind == "F":
        live.add(key)
    elif a.kind in ("B", "W"):
        live.discard(key)
    peak[s] = max(peak[s], len(live))


def _check_end(schedule, P, idx, posted, matched, sends, *, clock, peak, limit) -> None:
    """After the walk: every stage finished, every message matched, each stage's clock past
    its sends' completion, no stage's stash above the schedule's promise (``limit``)."""
    stuck = [s for s in range(P) if idx[s] < len(schedule[s])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(
            f"stage {s} waits at action {idx[s]}: {schedule[s][idx[s]]}" for s in stuck))
    leftovers = [(k, e) for k, entries in posted.items() for e in entries]
    if leftovers:
        k, e = leftovers[0]
        raise ScheduleError(f"stage {e[1]}: {e[4]} has no matching "
                            f"{'receive' if e[0] == 'SEND' else 'send'}")
    for s in range(P):              # the end of the step waits for every send to complete
        clock[s] = max([clock[s]] + [matched[(s, i, j)] for i, j in sends[s]])
    if limit is not None:
        for s in range(P):
            if peak[s] > limit[s]:
                raise ScheduleError(f"stage {s} stashes {peak[s]} micro-batches, more than the "
                                    f"{limit[s]} the schedule promises")


def _post(posted, matched, key, op, s, i, *, j, t, send_cost) -> None:
    other = "RECV" if op.kind == "SEND" else "SEND"
    queue = posted.setdefault(key, [])
    for n, e in enumerate(queue):
        if e[0] == other:                            # in order: the oldest waiting partner
            queue.pop(n)
            if op.shape is not None and e[4].shape is not None and op.shape != e[4].shape:
                raise ScheduleError(f"shape mismatch: stage {s} {op} has shape {op.shape}, "
                                    f"stage {e[1]} {e[4]} has {e[4].shape}")
            done = max(t, e[5]) + send_cost
            matched[(s, i, j)] = done
            matched[(e[1], e[2], e[3])] = done
            return
    queue.append((op.kind, s, i, j, op, t))


def _check_compute(schedule, P, m, v) -> None:
    """Every (mb, chunk) has one F and one B (or one I and one W) on its stage, F before B,
    I before W — the order constraints the simulation alone would not catch."""
    for s, actions in enumerate(schedule):
        seen: dict = {}
        for n, a in enumerate(actions):
            if a.kind == "COMM":
                continue
            if not (0 <= a.mb < m and 0 <= a.chunk < v):
                raise ScheduleError(f"stage {s}: action {n} {a} names micro-batch {a.mb} / "
                                    f"chunk {a.chunk}, outside {m} micro-batches x {v} chunks")
            kinds = seen.setdefault((a.mb, a.chunk), [])
            if a.kind in kinds:
                raise ScheduleError(f"stage {s}: {a} appears twice")
            need = {"B": "F", "I": "F", "W": "I"}.get(a.kind)
            if need and need not in kinds:
                raise ScheduleError(f"stage {s}: {a} comes before {need}{a.mb}"
                                    + (f".{a.chunk}" if a.chunk else ""))
            kinds.append(a.kind)
        for mb in range(m):
            for ch in range(v):
                kinds = set(seen.get((mb, ch), []))
                if kinds not in ({"F", "B"}, {"F", "I", "W"}):
                    raise ScheduleError(f"stage {s}: micro-batch {mb} chunk {ch} has "
                                        f"{sorted(kinds) or 'no actions'}; needs F and B, or "
                                        "F, I and W")
