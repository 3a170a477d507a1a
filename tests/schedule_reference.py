"""The greedy list scheduler (ZB-V's, :func:`fxpipe.schedule.generators._list_schedule`) as
defined, for tests to compare the incremental one against."""

from __future__ import annotations

from fxpipe.schedule.actions import Action, Op


def list_schedule_definition(p, m, s2r, limit, f_s, b_s, w_s):
    """Greedy list scheduling as defined: every rank re-examined for every action (any
    placement; None when stuck)."""
    n = len(s2r)
    own = [[s for s in range(n) if s2r[s] == r] for r in range(p)]
    done, t = {}, [0.0] * p
    nextf, nextb, pendw, held = [0] * n, [0] * n, [[] for _ in range(p)], [0] * p
    acts = [[] for _ in range(p)]
    for _ in range(3 * n * m):
        best = None
        for r in range(p):
            cands = []
            for s in own[r]:
                i = nextb[s]
                if i < m and ("F", s, i) in done:
                    dep = done[("F", s, i)] if s == n - 1 else done.get(("B", s + 1, i))
                    if dep is not None:
                        cands.append((max(t[r], dep), 0, s, Op.B, s, i))
                i = nextf[s]
                if i < m and held[r] < limit:
                    dep = 0.0 if s == 0 else done.get(("F", s - 1, i))
                    if dep is not None:
                        cands.append((max(t[r], dep), 1, -s, Op.F, s, i))
            if pendw[r]:
                s, i = pendw[r][0]
                cands.append((t[r], 2, -s, Op.W, s, i))
            if cands:
                c = min(cands)
                if best is None or (c[0], r) < (best[1][0], best[0]):
                    best = (r, c)
        if best is None:
            return None
        r, (start, _, _, op, s, i) = best
        t[r] = start + {Op.F: f_s, Op.B: b_s, Op.W: w_s}[op]
        done[(op.value, s, i)] = t[r]
        acts[r].append(Action(op, s, i))
        if op is Op.F:
            nextf[s] += 1
            held[r] += 1
        elif op is Op.B:
            nextb[s] += 1
            pendw[r].append((s, i))
        else:
            pendw[r].pop(0)
            held[r] -= 1
    return acts
