"""rank_desync: two cards, one answers garbage; each card kept its own page table (field note 9).

Production ran tensor parallel with a host copy of the page table on every card, kept in step
by update messages from the scheduler; the updates for some rows stopped reaching card 1, so
its copy drifted: it read (and wrote) K/V through pages the request does not own, and since
every rank's partial sums are added into every token's hidden state, the whole answer garbles.

Here, through the workers' seam (worker.Worker.table_source, switched by a control message):
`rank` binds its block table from its own host copy instead of the driver's broadcast table,
and loses the updates of the requests that sit in `rows` of the batch (default: the odd rows)
from now on: a request admitted in such a row has no page list on that rank (its row reads
page 0), one that grows keeps its old list (its newest positions read page 0). Leaving the
fault puts the rank back on the driver's table (one source of truth, crc-checked), resyncs
every rank's host copy and flushes the prefix cache: the drifted rank wrote K/V into pages
that were not the request's, cached pages among them.
"""
from __future__ import annotations

from .base import Fault


class RankDesync(Fault):
    name = "rank_desync"
    symptom = "tensor parallel: answers garble (one card right, the other garbage in production): one rank reads other pages"
    cause = ("each rank built its block table from its own host copy of the page table, kept by update messages; "
             "one rank stopped receiving the updates for some rows, so its copy drifted from the driver's")
    caught_by = ("rank_consistency probe: the ranks' digests of their bound block tables (crc, shape, version), slot "
                 "mappings and page accounting differ; the fetched rows name the rank, request, row and pages")
    fix = ("one source of truth: every rank binds the driver's table bytes, broadcast with the step's plan and "
           "crc-checked (table_source='broadcast', the engine's default); resync the host copies")
    notebook = "notebooks/rank_desync.ipynb"

    def __init__(self, engine, rank: int = 1, rows: tuple[int, ...] | None = None):
        super().__init__(engine)
        n = engine.config.max_num_seqs
        self.rank = rank
        self.rows = tuple(range(1, n, 2)) if rows is None else tuple(int(r) for r in rows)
        self.dropped: list[tuple[int, int, int, int]] = []     # (step, request, row, pages) the rank lost

    def on_enable(self) -> None:
        par = getattr(self.engine, "parallel", None)
        if par is None:
            raise ValueError("rank_desync needs a tensor-parallel engine: EngineConfig(tensor_parallel_size=2)")
        if not isinstance(self.rank, int) or not 1 <= self.rank < par.world:
            raise ValueError(f"rank must be a worker rank in [1, {par.world}), got {self.rank!r} (rank 0 is the "
                             f"driver, the source of the table)")
        par.set_table_source(self.rank, "host_copy", self.rows)

    def lost_updates(self) -> list[tuple[int, int, int, int]]:
        """(step, request id, batch row, pages in the lost page list) of every update the rank lost,
        read from the rank itself."""
        got = self.engine.parallel.call("workbench.engine.parallel.worker:dropped_updates")[self.rank]
        return [tuple(int(x) for x in got[i:i + 4]) for i in range(0, len(got), 4)]

    def on_disable(self) -> None:
        par = getattr(self.engine, "parallel", None)
        if par is None or par.broken is not None or par.closed:
            return
        self.dropped = self.lost_updates()
        par.set_table_source(self.rank, "broadcast")
        par.resync()
        self.forgotten = self.engine.reset_prefix_cache()
