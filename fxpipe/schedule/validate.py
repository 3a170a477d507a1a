"""Schedule validator: checks a per-rank action list and explains every violated rule
(:func:`validate`), and finds the first deadlock of a schedule (:func:`find_deadlock`)."""

from __future__ import annotations

from collections.abc import Iterable

from fxpipe.errors import ScheduleError
from fxpipe.schedule.actions import COMM_OPS, COMPUTE_OPS, Action, Op, Schedule

_MAX_PROBLEMS = 12


def validate(
    schedule: Schedule,
    edges: Iterable[tuple[int, int]] | None = None,
    grad_edges: Iterable[tuple[int, int]] | None = None,
    compute_only: bool | None = None,
) -> None:
    """Check a schedule; raise :class:`ScheduleError` explaining every violated rule.

    Rules (``m`` micro-batches, stages ``0..num_stages-1``):
      1. shape: one action list per rank, ``stage_to_rank`` covers every stage, micro-batch
         indices in ``0..m-1``; every action sits on the rank that holds its stage.
      2. every (stage, micro-batch) has exactly one F and one B, and exactly one W iff
         ``split_backward`` (none otherwise); on its rank, F before B before W.
      3. data dependencies between stages on the SAME rank follow list order: F of stage ``c``
         after F of every producer ``q`` (edge ``(q, c)``); B of ``q`` after B of every consumer
         ``c`` whose edge carries gradients.
      4. (full schedules) every cross-rank edge has, per micro-batch, one SEND_F after the
         producer's F and one matching RECV_F before the consumer's F (same stage pair,
         micro-batch, direction), and likewise SEND_B / RECV_B for gradient edges; no SEND
         without RECV or vice versa; no communication between stages of the same rank.
      5. (full schedules) one ALLREDUCE per stage on its rank after that stage's last B (last W
         when split); one STEP per rank, as its last action.
      6. no deadlock: a round-based run in which RECVs block until the matching SEND has been
         issued, SENDs never block, and (compute-only lists) an F/B waits for its producers'
         F / consumers' B on other ranks. Stuck ranks are reported with the action they wait at.

    Args:
        schedule: the schedule to check.
        edges: ``(producer_stage, consumer_stage)`` pairs; default the linear chain. Edges with a
            negative producer (model inputs) are ignored.
        grad_edges: edges whose values carry gradients back; default all ``edges``.
        compute_only: True to check F/B/W lists without communication (rules 4-5 skipped);
            default: auto (True when the schedule holds only F/B/W actions).

    Raises:
        ScheduleError: listing each problem (at most 12, then a count) and how to fix it.
    """
    p, n, m = schedule.num_ranks, schedule.num_stages, schedule.microbatches
    if edges is None:
        edges = {(s, s + 1) for s in range(n - 1)}
    edges = {e for e in set(edges) if e[0] >= 0}
    grad_edges = edges if grad_edges is None else {e for e in set(grad_edges) if e[0] >= 0}
    head = f"schedule {schedule.name!r} (p={p}, stages={n}, m={m}) is invalid"
    problems: list[str] = []

    def fail() -> None:
        if problems:
            more = len(problems) - _MAX_PROBLEMS
            lines = problems[:_MAX_PROBLEMS] + ([f"... and {more} more"] if more > 0 else [])
            raise ScheduleError(head + ":\n  - " + "\n  - ".join(lines))

    # ---- rule 1: shape
    if len(schedule.actions) != p:
        problems.append(
            f"{len(schedule.actions)} action lists for {p} ranks; give one list per rank"
        )
    if len(schedule.stage_to_rank) != n:
        problems.append(f"stage_to_rank has {len(schedule.stage_to_rank)} entries for {n} stages")
    bad_r = [s for s, r in enumerate(schedule.stage_to_rank) if not 0 <= r < p]
    if bad_r:
        problems.append(f"stages {bad_r} are placed on ranks outside 0..{p - 1}")
    for e in sorted(edges | grad_edges):
        if not (0 <= e[0] < n and 0 <= e[1] < n) or e[0] >= e[1]:
            problems.append(f"edge {e} is not a forward edge between stages 0..{n - 1}")
    fail()
    s2r = schedule.stage_to_rank
    if compute_only is None:
        compute_only = all(a.op in COMPUTE_OPS for acts in schedule.actions for a in acts)
    if not grad_edges <= edges:
        problems.append(f"grad_edges {sorted(grad_edges - edges)} are not forward edges")
    pos: dict[tuple, tuple[int, int]] = {}  # (op, stage, mb[, peer]) -> (rank, index)
    counts: dict[tuple, int] = {}
    for r, acts in enumerate(schedule.actions):
        for k, a in enumerate(acts):
            if not 0 <= a.stage < n and not (a.op is Op.STEP and a.stage == -1):
                problems.append(
                    f"rank {r} action #{k} {a} names stage {a.stage} outside 0..{n - 1}"
                )
                continue
            if a.op is not Op.STEP and s2r[a.stage] != r:
                problems.append(
                    f"{a} is on rank {r} but stage {a.stage} is placed on rank {s2r[a.stage]}; "
                    f"move it to rank {s2r[a.stage]}'s list"
                )
            if a.op in COMPUTE_OPS or a.op in COMM_OPS:
                if not 0 <= a.microbatch < m:
                    problems.append(
                        f"rank {r}: {a} has micro-batch {a.microbatch} outside 0..{m - 1}"
                    )
            if a.op in COMM_OPS and not 0 <= a.peer < n:
                problems.append(f"rank {r}: {a} has peer stage {a.peer} outside 0..{n - 1}")
            if compute_only and a.op not in COMPUTE_OPS:
                problems.append(f"rank {r}: {a} in a compute-only check")
            key = (a.op, a.stage, a.microbatch, a.peer)
            counts[key] = counts.get(key, 0) + 1
            pos.setdefault(key, (r, k))
    fail()

    def at(op: Op, s: int, i: int = -1, peer: int = -1) -> tuple[int, int] | None:
        return pos.get((op, s, i, peer))

    # ---- rule 2: compute counts and order
    split = schedule.split_backward
    for s in range(n):
        for i in range(m):
            for op in COMPUTE_OPS:
                want = 0 if (op is Op.W and not split) else 1
                got = counts.get((op, s, i, -1), 0)
                if got != want:
                    if want == 0:
                        problems.append(
                            f"{s}W{i} present but split_backward is False (the B already computes "
                            f"weight gradients); remove W actions or set split_backward=True"
                        )
                    elif got == 0:
                        problems.append(
                            f"missing {s}{op.value}{i}: stage {s} micro-batch {i} has no "
                            f"{op.value} on rank {s2r[s]}; add it"
                        )
                    else:
                        problems.append(
                            f"{s}{op.value}{i} appears {got} times on rank {s2r[s]}; each "
                            f"(stage, micro-batch) needs exactly one {op.value}"
                        )
            order = [(Op.F, Op.B)] + ([(Op.B, Op.W)] if split else [])
            for a_op, b_op in order:
                pa, pb = at(a_op, s, i), at(b_op, s, i)
                if pa and pb and pa[1] > pb[1]:
                    problems.append(
                        f"{s}{b_op.value}{i} comes before {s}{a_op.value}{i} on rank {s2r[s]}; "
                        f"{a_op.value} must run first"
                    )
    fail()

    # ---- rule 3: same-rank data dependencies
    for q, c in sorted(edges):
        if s2r[q] != s2r[c]:
            continue
        for i in range(m):
            if at(Op.F, c, i)[1] < at(Op.F, q, i)[1]:
                problems.append(
                    f"rank {s2r[q]}: {c}F{i} runs before {q}F{i}, but stage {c} reads stage {q}'s "
                    f"output; order {q}F{i} first"
                )
            if (q, c) in grad_edges and at(Op.B, q, i)[1] < at(Op.B, c, i)[1]:
                problems.append(
                    f"rank {s2r[q]}: {q}B{i} runs before {c}B{i}, but stage {q} needs the "
                    f"gradient stage {c} computes; order {c}B{i} first"
                )
    fail()

    # ---- rules 4-5: communication, all-reduce, step
    if not compute_only:
        expected: dict[tuple, tuple[tuple, str]] = {}  # comm key -> (compute key, before/after)
        for q, c in sorted(edges):
            if s2r[q] == s2r[c]:
                continue
            for i in range(m):
                expected[(Op.SEND_F, q, i, c)] = ((Op.F, q, i, -1), "after")
                expected[(Op.RECV_F, c, i, q)] = ((Op.F, c, i, -1), "before")
                if (q, c) in grad_edges:
                    expected[(Op.SEND_B, c, i, q)] = ((Op.B, c, i, -1), "after")
                    expected[(Op.RECV_B, q, i, c)] = ((Op.B, q, i, -1), "before")
        partner = {
            Op.SEND_F: Op.RECV_F,
            Op.RECV_F: Op.SEND_F,
            Op.SEND_B: Op.RECV_B,
            Op.RECV_B: Op.SEND_B,
        }
        for key, cnt in sorted(counts.items(), key=lambda kv: str(kv[0])):
            op, s, i, peer = key
            if op not in COMM_OPS:
                continue
            a = Action(op, s, i, peer)
            mate = Action(partner[op], peer, i, s)
            if key not in expected:
                if s2r[s] == s2r[peer]:
                    why = (
                        f"stages {s} and {peer} are both on rank {s2r[s]}: the value is handed "
                        f"over locally; remove it"
                    )
                elif op in (Op.SEND_B, Op.RECV_B) and tuple(sorted((s, peer))) in edges:
                    why = "the edge carries no gradient (not in grad_edges); remove it"
                else:
                    why = f"there is no edge between stages {min(s, peer)} and {max(s, peer)}"
                problems.append(f"rank {s2r[s]}: unexpected {a}: {why}")
            elif cnt > 1:
                problems.append(f"rank {s2r[s]}: {a} appears {cnt} times; keep one")
            if (mate.op, mate.stage, i, mate.peer) not in counts and 0 <= peer < n:
                kind = "send" if op in (Op.SEND_F, Op.SEND_B) else "receive"
                problems.append(
                    f"unmatched {kind}: rank {s2r[s]} has {a} but rank {s2r[peer]} has no "
                    f"{mate}; add the matching {'RECV' if kind == 'send' else 'SEND'}"
                )
        for key, (ckey, rel) in sorted(expected.items(), key=lambda kv: str(kv[0])):
            a = Action(*key)
            if key not in counts:
                problems.append(
                    f"missing {a} on rank {s2r[key[1]]} (edge between stages {key[1]} and "
                    f"{key[3]} crosses ranks); add it {rel} {Action(*ckey)}"
                )
                continue
            pk, pc = pos[key][1], pos[ckey][1]
            if (rel == "after" and pk < pc) or (rel == "before" and pk > pc):
                problems.append(
                    f"rank {s2r[key[1]]}: {a} must come {rel} {Action(*ckey)}"
                )
        last_op = Op.W if split else Op.B
        for s in range(n):
            cnt = counts.get((Op.ALLREDUCE, s, -1, -1), 0)
            if cnt != 1:
                problems.append(
                    f"rank {s2r[s]}: stage {s} has {cnt} ALLREDUCE actions; it needs exactly one "
                    f"after its last {last_op.value}"
                )
                continue
            ar = pos[(Op.ALLREDUCE, s, -1, -1)][1]
            late = [i for i in range(m) if at(last_op, s, i)[1] > ar]
            if late:
                problems.append(
                    f"rank {s2r[s]}: {s}ALLREDUCE comes before {s}{last_op.value}{late[0]}; "
                    f"all-reduce gradients after the stage's last {last_op.value}"
                )
        for r, acts in enumerate(schedule.actions):
            steps = [k for k, a in enumerate(acts) if a.op is Op.STEP]
            if len(steps) != 1 or steps[0] != len(acts) - 1:
                problems.append(
                    f"rank {r}: needs exactly one STEP as its last action (has {len(steps)})"
                )
    fail()

    # ---- rule 6: deadlock
    stuck = find_deadlock(schedule, edges, grad_edges)
    if stuck:
        problems.append(stuck)
    fail()


def find_deadlock(
    schedule: Schedule,
    edges: set[tuple[int, int]],
    grad_edges: set[tuple[int, int]],
) -> str | None:
    """Run the lists round by round (RECV blocks until its SEND was issued, SEND never blocks,
    cross-rank F/B dependencies block). Return None if every rank finishes, else a message
    ``"deadlock: rank 0 waits at 1RECV_F3@0 for ... ; rank 1 waits at ..."``."""
    s2r = schedule.stage_to_rank
    prod: dict[int, list[int]] = {}
    gcons: dict[int, list[int]] = {}
    for q, c in edges:
        if s2r[q] != s2r[c]:
            prod.setdefault(c, []).append(q)
    for q, c in grad_edges:
        if s2r[q] != s2r[c]:
            gcons.setdefault(q, []).append(c)
    done: set[tuple] = set()
    ptr = [0] * len(schedule.actions)

    def needs(a: Action) -> list[Action]:
        if a.op is Op.RECV_F:
            return [Action(Op.SEND_F, a.peer, a.microbatch, a.stage)]
        if a.op is Op.RECV_B:
            return [Action(Op.SEND_B, a.peer, a.microbatch, a.stage)]
        if a.op is Op.F:
            return [Action(Op.F, q, a.microbatch) for q in prod.get(a.stage, [])]
        if a.op is Op.B:
            return [Action(Op.B, c, a.microbatch) for c in gcons.get(a.stage, [])]
        return []

    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(schedule.actions):
            while ptr[r] < len(acts) and all(x in done for x in needs(acts[ptr[r]])):
                done.add(acts[ptr[r]])
                ptr[r] += 1
                progress = True
    if all(ptr[r] == len(acts) for r, acts in enumerate(schedule.actions)):
        return None
    parts = []
    for r, acts in enumerate(schedule.actions):
        if ptr[r] == len(acts):
            continue
        a = acts[ptr[r]]
        missing = [x for x in needs(a) if x not in done]
        why = []
        for x in missing:
            xr = s2r[x.stage]
            blocked = schedule.actions[xr][ptr[xr]] if ptr[xr] < len(schedule.actions[xr]) else None
            if x in schedule.actions[xr]:
                why.append(f"{x} on rank {xr} (rank {xr} is blocked earlier, at {blocked})")
            else:
                why.append(f"{x} on rank {xr}, which never issues it")
        parts.append(f"rank {r} waits at {a} (action #{ptr[r]}) for " + " and ".join(why))
    return (
        "deadlock: "
        + "; ".join(parts)
        + ". Reorder the lists so every RECV's SEND is issued before the receiver blocks on it"
    )
