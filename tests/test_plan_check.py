"""probes/plan_check.py: the compiled decode kernel's rows and tables judged vectorised, as the
per-row statement of the rule (kept here as the oracle) judges them, on random corruptions."""
from types import SimpleNamespace

import numpy as np
import torch

from probes import plan_check
from probes.invariants import Mismatch, reference


def oracle(g, ref) -> tuple[list, set]:
    """The rule one row at a time (what _decode_native computed before it was vectorised)."""
    out = []
    tok, rows, lens = (t.numpy().astype(np.int64) for t in (g.tok, g.rows, g.lens))
    for k in range(len(tok)):
        r = int(rows[k])
        want_tok = int(ref.cu_q[r]) if 0 <= r < len(ref.q_lens) else None
        if tok[k] != want_tok or not 0 <= tok[k] < ref.num_tokens or ref.seq_of_tok[tok[k]] != r:
            who = int(plan_check._row_of_token(ref, tok[k:k + 1])[0])
            out.append(Mismatch("plan", "plan.decode.rows", who, int(tok[k]), r, who))
        elif lens[k] != ref.context_lens[r]:
            out.append(Mismatch("plan", "plan.decode.lens", r, int(tok[k]), int(lens[k]), int(ref.context_lens[r])))
    tables = g.tables.numpy().astype(np.int64)
    for r in sorted(set(rows.tolist())):
        if 0 <= r < len(ref.need) and r < tables.shape[0]:
            n = min(int(ref.need[r]), tables.shape[1])
            bad = np.nonzero(tables[r, :n] != ref.table[r, :n])[0]
            if len(bad) and not ref.short[r]:
                c = int(bad[0])
                out.append(Mismatch("plan", "plan.decode.tables", r, c, int(tables[r, c]), int(ref.table[r, c])))
    return out, set(rows.tolist())


def test_decode_rows_and_tables_are_judged_as_the_per_row_rule_judges_them():
    rng = np.random.default_rng(0)
    ps = 16
    found = 0
    for case in range(300):
        b = int(rng.integers(1, 9))
        computed = rng.integers(0, 90, b)
        q = np.ones(b, dtype=np.int64)
        pages = [rng.permutation(200)[: -(-(c + 1) // ps)].tolist() for c in computed]
        if rng.random() < 0.2:                                   # a short page list
            pages[0] = pages[0][:-1]
        ref = reference(computed.tolist(), q.tolist(), pages, ps)
        tok, rows, lens = np.arange(b), np.arange(b), (computed + 1).copy()
        width = ref.table.shape[1] + int(rng.integers(0, 2))
        tables = np.zeros((b, width), dtype=np.int64)
        tables[:, : ref.table.shape[1]] = ref.table
        k = int(rng.integers(0, b))
        what = rng.integers(0, 6)
        if what == 1:
            tok[k] = (tok[k] + 1) % (b + 1)
        elif what == 2:
            rows[k] = int(rng.choice([-1, b, (k + 1) % b]))
        elif what == 3:
            lens[k] += int(rng.choice([-1, 1]))
        elif what == 4:
            tables[k, int(rng.integers(0, width))] += 1
        elif what == 5:
            tables = tables[:, :-1] if width > 1 else tables
        g = SimpleNamespace(tok=torch.tensor(tok, dtype=torch.int32), rows=torch.tensor(rows, dtype=torch.int32),
                            lens=torch.tensor(lens, dtype=torch.int32), tables=torch.tensor(tables, dtype=torch.int32))
        got: list = []
        covered = plan_check._decode_native(g, ref, got)
        want, want_covered = oracle(g, ref)
        assert got == want and covered == want_covered, (case, what, got, want)
        found += bool(want)
    assert 150 < found < 300            # the corruptions are found (and the clean cases are clean)
