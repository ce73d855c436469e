"""The per-rank strip of a tensor-parallel engine's dashboard: step time, bandwidth, digest agreement.

One row per rank, from the RankStepFinished events in the EventLog (the workers' numbers reach
rank 0 with every step): its last step time and the median of the recent ones, the share of it
spent in collectives, the bytes it streamed per second of its step, and whether the block
table it bound (crc32 of its bytes) agreed with rank 0's, at the last step and over the window.
A rank that drifted (the rank_desync fault) shows red in the last column.
"""
from __future__ import annotations

import html

import ipywidgets as W
import numpy as np

from ..events import RankStepFinished

WINDOW = 64          # recent steps the medians and the agreement count cover


def rank_rows(log, world: int, window: int = WINDOW) -> list[dict]:
    """One dict per rank over the last `window` steps of RankStepFinished in log."""
    cols = log.tables.get(RankStepFinished) if log is not None else None
    if not cols or not cols["step"]:
        return [{"rank": r, "steps": 0} for r in range(world)]
    step = np.asarray(cols["step"][-window * world:])
    rank = np.asarray(cols["rank"][-window * world:])
    dur = np.asarray(cols["duration_ns"][-window * world:], dtype=np.float64)
    comm = np.asarray(cols["comm_ns"][-window * world:], dtype=np.float64)
    nbytes = np.asarray(cols["bytes"][-window * world:], dtype=np.float64)
    crc = np.asarray(cols["table_crc"][-window * world:])
    ref = {int(s): int(c) for s, r, c in zip(step, rank, crc) if r == 0}
    out = []
    for r in range(world):
        m = rank == r
        if not m.any():
            out.append({"rank": r, "steps": 0})
            continue
        s, d, c, b, k = step[m], dur[m], comm[m], nbytes[m], crc[m]
        agree = np.array([ref.get(int(si)) == int(ki) for si, ki in zip(s, k)])
        out.append({"rank": r, "steps": int(m.sum()), "last_step": int(s[-1]), "last_ms": d[-1] / 1e6,
                    "median_ms": float(np.median(d)) / 1e6, "comm_share": float(c.sum() / max(d.sum(), 1.0)),
                    "gb_s": float(b.sum() / max(d.sum(), 1.0)), "agree_last": bool(agree[-1]),
                    "disagree": int((~agree).sum())})
    return out


class RankStrip:
    def __init__(self, log, world: int):
        self.log, self.world = log, world
        self.widget = W.HTML(layout=W.Layout(min_width="250px"))
        self.widget.add_class("kvwb-rank-strip")
        self.refresh()

    def refresh(self) -> None:
        rows = rank_rows(self.log, self.world)
        cells = []
        for row in rows:
            if not row["steps"]:
                cells.append(f"<tr><td>rank {row['rank']}</td><td colspan=5>no step yet</td></tr>")
                continue
            ok = row["agree_last"]
            colour = "#2a7" if ok and not row["disagree"] else ("#c00" if not ok else "#c80")
            mark = "agrees" if ok else "DIFFERS"
            if row["disagree"]:
                mark += f" ({row['disagree']} of last {row['steps']})"
            cells.append(
                f"<tr><td>rank {row['rank']}</td><td>{row['last_ms']:.1f} ms</td><td>{row['median_ms']:.1f} ms</td>"
                f"<td>{row['comm_share']:.0%}</td><td>{row['gb_s']:.1f} GB/s</td>"
                f"<td style='color:{colour};font-weight:bold'>{mark}</td></tr>")
        head = ("<tr><th></th><th>last step</th><th>median</th><th>comm</th><th>bandwidth</th>"
                "<th>table digest vs rank 0</th></tr>")
        self.widget.value = (f"<div style='font-size:12px'><b>{html.escape(f'{self.world} ranks (tensor parallel)')}</b>"
                             f"<table style='border-collapse:collapse'>{head}{''.join(cells)}</table></div>")
