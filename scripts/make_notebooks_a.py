"""Write the fault-diagnosis notebooks for stale_binding, page_out_of_range, free_while_shared,
cu_seqlens_corrupt and fp16_kv_overflow (issue 6), without outputs.

    python scripts/make_notebooks_a.py          # rewrites notebooks/<fault>.ipynb

The notebooks are generated so their cells stay reviewable as code and carry stable cell
ids (a rerun changes nothing unless the text here changed). tests/test_notebooks.py runs them.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def md(text: str) -> tuple[str, str]:
    return ("markdown", textwrap.dedent(text).strip())


def code(text: str) -> tuple[str, str]:
    return ("code", textwrap.dedent(text).strip())


def write(name: str, cells: list[tuple[str, str]]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    for i, (kind, src) in enumerate(cells):
        cell = nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
        cell.id = f"{name.replace('_', '-')}-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    path = NOTEBOOKS / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


# ---- shared opening: the default model answering real chat prompts ------------------------
SETUP = code("""
    import pandas as pd
    import plotly.express as px
    from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults

    pd.set_option("display.max_colwidth", None)                  # show whole answers and messages
    engine = Engine.from_default(EngineConfig(num_pages=64))     # SmolLM2-135M-Instruct, 16-token pages
    questions = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?"]
    prompts = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0.0)       # greedy: any change is the fault's
""")


def catalogue_row(name: str):
    return code(f"""
        for field, text in faults.catalogue().set_index("fault").loc["{name}"].items():
            print(f"{{field:>9}}: {{text}}")
    """)


# ---- stale_binding ------------------------------------------------------------------------
STALE = [
    md("""
        # Stale binding: garbled text once the page table changes

        **What production saw** (field note 1, Ascend 910B): *"the page table was updated, but the kernel
        was launched with the old binding (the re-bind call had drifted to after the kernel launch in a
        refactor). Symptom: garbled text, first step after growth reads old pages."* The diagnosis that
        worked: *compare the table version the kernel consumed with the current one.*

        Here: reproduce it on the default model, let the `page_table` probe name the request and page,
        see why it happens, apply the fix and run clean again.
    """),
    SETUP,
    md("""
        ## 1. Reproduce: the re-bind after the kernel launch
        `faults.inject(engine, "stale_binding")` moves `BlockTables.bind()` from before `model.forward` to
        after it, as the refactor did. The `page_table` probe watches. The whole generation runs inside
        the with-block: on exit the fault drops the prefix-cache entries it poisoned.
    """),
    code("""
        wb = Workbench(engine).attach("page_table")
        with faults.inject(engine, "stale_binding") as fault:
            garbled = engine.generate(prompts, params)
        print(f"{fault.late_binds} forwards ran before their block table was bound\\n")
        for q, o in zip(questions, garbled):
            print(f"Q: {q}\\nA: {o.text!r}\\n")
    """),
    md("""
        ## 2. What the probe found
        For every forward, the probe compares the block-table version each attention kernel read
        (`AttentionRead.block_table_version`) with the version current for the step
        (`BlockTables.host_version`). When they differ it compares the rows the kernel read with the
        page tables and names each request that read a page it does not own.
    """),
    code("""
        caught = wb.all_findings()        # Finding objects (kept: wb.reset() below clears the probes)
        found = wb.findings
        found[["severity", "kind", "step", "request_id", "page", "message"]]
    """),
    md("""
        The first error, in detail: the row of the block table the kernel read, against the row the
        page table means at that step.
    """),
    code("""
        first = next(f for f in caught if f.kind == "stale-binding" and f.severity == "error")
        ev = first.evidence
        print(f"step {first.step}, request {first.request_id}: version read {ev['version_read']}, "
              f"current {ev['version_current']}\\nhint: {first.hint}")
        pd.DataFrame({"kernel read": ev["row_read"], "page table": ev["row_meant"]},
                     index=[f"page {i}" for i in range(len(ev["row_read"]))]).T
    """),
    md("""
        **The view.** From the event log: the steps in which the table changed (a request got pages, or
        one finished and the rows below it moved up) and the steps in which the probe caught a stale
        read. The stale reads sit on the steps right where the table changed: the kernel still held
        the previous step's rows.
    """),
    code("""
        log = wb.log
        changed = pd.concat([
            log.frame("PagesAllocated").assign(event="got pages (admitted or grew)"),
            log.frame("RequestFinished").assign(event="finished (rows below move up)"),
            found[found.kind == "stale-binding"].assign(event="stale read (page_table probe)"),
        ])[["step", "request_id", "event"]].dropna()
        px.scatter(changed, x="step", y=changed["request_id"].astype(int).astype(str), color="event",
                   symbol="event", labels={"y": "request"}, height=320,
                   title="stale_binding: the kernel reads the previous step's table")
    """),
    md("""
        ## 3. Root cause
        Every step the batch builder stages the new page lists in a host buffer (a new *current*
        version) and `bind()` publishes them to the device buffer the kernels read. With the bind after
        the launch, each forward reads the previous step's table. That is harmless while no row
        changes, which is why it survived testing; but on the first step in which a sequence grows a
        page, a request joins, or one leaves and the rows shift, the kernel reads a padding 0 or another
        sequence's page. Paged-attention kernels do not check whose page it is: the request attends over
        someone else's KV and answers garbage.
    """),
    catalogue_row("stale_binding"),
    md("""
        ## 4. The fix: bind before the launch
        The engine's own step binds in `BatchBuilder.build(bind=True)`, before `model.forward`; leaving
        the with-block restores exactly that order. Same prompts, probe still on:
    """),
    code("""
        wb.reset()
        fixed = engine.generate(prompts, params)
        pd.DataFrame({"question": questions, "stale binding": [o.text for o in garbled],
                      "bind before launch": [o.text for o in fixed]})
    """),
    code("""
        wb.findings_at_least("warn")      # nothing: the versions match on every step
    """),
    md("## 5. Checks: the diagnosis still works"),
    code("""
        errors = [f for f in caught if f.kind == "stale-binding" and f.severity == "error"]
        assert errors, "the page_table probe did not catch the stale binding"
        for f in errors:
            assert f.evidence["version_read"] < f.evidence["version_current"]
            assert f.evidence["page_read"] != f.evidence["page_meant"]
        # The symptom is real, and every request whose text changed was named by the probe.
        changed = {g.request_id for g, c in zip(garbled, fixed) if g.token_ids != c.token_ids}
        assert changed, "the fault did not change any answer"
        assert changed <= {f.request_id for f in errors}
        # The fix clears it: clean answers, no finding of severity warn or above.
        assert "Paris" in fixed[0].text
        assert wb.findings_at_least("warn") == []
        wb.detach()
    """),
]


# ---- page_out_of_range ----------------------------------------------------------------------
OOR = [
    md("""
        # Page id out of range: one request answers NaN, zeros or nothing

        **What production saw** (field note 2): *"Out-of-range page ids: kernels read illegal addresses;
        outputs all zeros or NaN. Check every id in [0, num_pages). Ascend kernels do not validate block
        ids."* On a card the same bug can also end in an illegal-memory-access crash.

        Here: put one bad id in the bound block table, watch one request break while the others answer,
        let the `page_table` probe name the request, the row, the column and the id, and run clean again.
    """),
    SETUP,
    md("""
        ## 1. Reproduce: one id past the pool in the bound table
        `faults.inject(engine, "page_out_of_range", row=1)` writes `num_pages` (the first id past the
        pool) into the newest column of batch row 1 of the bound device table, for one step. torch on a
        CPU checks indices and would raise instead; to show what the device did, the fault models the
        memory past the pool as NaN (`fill="zeros"` models zeroed memory; `unchecked=False` keeps the
        bounds check, the IndexError standing in for the crash).

        A small listener keeps the table each step's kernel reads, for the view below.
    """),
    code("""
        from workbench.events import BatchPacked

        tables = {}                       # step -> (request ids, the bound block table the kernel reads)
        keep = lambda e: tables.__setitem__(e.step, (e.request_ids, engine.last_batch.block_tables.tolist()))
        engine.bus.subscribe(BatchPacked, keep)

        wb = Workbench(engine).attach("page_table")
        with faults.inject(engine, "page_out_of_range", row=1) as fault:
            broken = engine.generate(prompts, params)
        engine.bus.unsubscribe(keep)
        print("corrupted:", fault.corrupted, "\\n")
        for q, o in zip(questions, broken):
            print(f"Q: {q}\\nA: {o.text!r}  (tokens {o.token_ids[:6]}..., {o.finish_reason})\\n")
    """),
    md("""
        One answer breaks off after its first word, and every token after it is id 0, `<|endoftext|>`:
        its attention read NaN from past the pool, the logits became NaN and argmax picked token 0. The
        NaN hidden state was also written into the request's own KV pages, so it never recovers, though
        the bad id was there for one step only. The other requests are untouched, which is what made this
        hard to find in production.

        ## 2. What the probe found
        Once per forward, before any page is read, the probe checks every id the kernel will read in
        the bound block table against `[0, num_pages)`.
    """),
    code("""
        found = wb.findings
        found[["severity", "kind", "step", "request_id", "page", "message"]]
    """),
    code("""
        hit = wb.findings_at_least("error")[0]
        print(hit.message, "\\nhint:", hit.hint)
        hit.evidence
    """),
    md("""
        **The view.** The block table the kernel read at that step: one row per request, one column per
        page, the colour the page id. Every id should be below the pool size; one is not.
    """),
    code("""
        rids, table = tables[hit.step]
        fig = px.imshow(table, text_auto=True, color_continuous_scale="Reds", aspect="auto",
                        labels={"x": "page column", "y": "request", "color": "page id"},
                        y=[str(r) for r in rids], height=260,
                        title=f"step {hit.step}: the bound block table (pool: pages 0..{engine.num_pages - 1})")
        fig
    """),
    md("""
        ## 3. Root cause
        The paged kernels (Ascend paged attention, `flash_attn_with_kvcache`) trust the block table:
        an id `>= num_pages` makes them read whatever lies past the KV pool (other allocations, freed
        memory: NaN or zeros) or fault. The id itself comes from elsewhere: a table sized for another
        pool, an unmasked padding id, an id from another card's pool. The probe names the row and column,
        so the writer of that entry is the one to find.
    """),
    catalogue_row("page_out_of_range"),
    md("""
        ## 4. The fix: only ids inside the pool reach the kernel
        With the writer of the bad id fixed (here: the with-block's end undoes it), the same prompts
        answer normally and the probe, still attached, stays quiet. Keep the `[0, num_pages)` check at
        bind time in debug builds: it costs one pass over `B x W` ints.
    """),
    code("""
        wb.reset()
        fixed = engine.generate(prompts, params)
        pd.DataFrame({"question": questions, "id past the pool": [o.text for o in broken],
                      "ids in range": [o.text for o in fixed]})
    """),
    code("""
        wb.findings_at_least("warn")
    """),
    md("## 5. Checks: the diagnosis still works"),
    code("""
        [c] = fault.corrupted
        target = broken[1].request_id
        assert c["request_id"] == target and c["page_id"] == engine.num_pages
        first = hit
        assert first.kind == "page-out-of-range" and first.severity == "critical"
        assert (first.request_id, first.page, first.step) == (target, engine.num_pages, c["step"])
        assert first.evidence["page_meant"] == c["page_meant"]
        assert max(max(row) for row in tables[c["step"]][1]) == engine.num_pages     # what the kernel read
        # The symptom: that request broke, the others did not.
        assert broken[1].token_ids != fixed[1].token_ids
        assert broken[0].token_ids == fixed[0].token_ids and broken[2].token_ids == fixed[2].token_ids
        # The fix clears it.
        assert "Paris" in fixed[0].text and wb.findings_at_least("warn") == []
        wb.detach()
    """),
]


# ---- free_while_shared ------------------------------------------------------------------------
FWS = [
    md("""
        # Free while shared: garbage only on prefix-cache hits

        **What production saw** (field note 3): *"Missing refcount with prefix sharing: one request
        finishes, frees pages another request still reads; they are reallocated; the survivor reads
        someone else's KV. Symptom: garbage only on prefix-cache hits"* (public: vllm #7003, vllm-ascend
        #5269, Qwen2.5 garbled on prefix-cache hit).

        Here: two requests share a document as a prompt prefix, the first one finishes, a stranger
        arrives; with the refcount dropped, the survivor answers garbage. The `page_table` probe names
        the pages, the request and the step; then the fix and a clean run.
    """),
    code("""
        import inspect
        import pandas as pd
        import plotly.express as px
        from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
        from workbench.engine.pages import PagePool

        pd.set_option("display.max_colwidth", None)

        # A tight pool (8 pages of 16 tokens), as in production under load: a stranger's pages come
        # from the ones just freed.
        engine = Engine.from_default(EngineConfig(num_pages=8))
    """),
    md("""
        ## 1. The workload: a shared prefix, then a stranger
        A and B ask about the same refund policy, so B's prompt starts with the same 64 tokens (4 full
        pages) as A's: a prefix-cache hit, B maps A's pages. A finishes after two tokens. Then C, about
        something else, arrives and needs pages.
    """),
    code("""
        POLICY = ("Our store's refund policy: items can be returned within 30 days of delivery for a full refund. "
                  "Sale items can only be exchanged. Shipping costs are refunded only when the item arrived damaged.")
        A = [{"role": "user", "content": POLICY + "\\n\\nHow many days do I have to return an item?"}]
        B = [{"role": "user", "content": POLICY + "\\n\\nWhat does the policy say about sale items?"}]
        C = [{"role": "user", "content": "Write a short poem about the moon and the stars over the quiet sea at "
              "night. The poem should mention a lighthouse, a small fishing boat, the smell of salt and the sound "
              "of waves on the rocks, and end with the sunrise."}]

        def serve(engine):
            \"\"\"A arrives; B (same prefix) one step later; C once A has finished. Returns {name: output}.\"\"\"
            done, ids = {}, {}
            def step():
                for o in engine.step():
                    if o.finished:
                        done[o.request_id] = o
            ids["A"] = engine.add_request(A, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            step()
            ids["B"] = engine.add_request(B, SamplingParams(max_tokens=24, temperature=0.0))
            while ids["A"] not in done:
                step()
            ids["C"] = engine.add_request(C, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished():
                step()
            return {k: done[r] for k, r in ids.items()}
    """),
    md("""
        ## 2. Reproduce: the free path ignores the refcount
        `faults.inject(engine, "free_while_shared")` makes `PagePool.free` release a page even when
        another sequence still holds a reference to it. The workload runs to completion inside the
        with-block (a request still live at exit would map pages the fault already gave away).
    """),
    code("""
        wb = Workbench(engine).attach("page_table")
        with faults.inject(engine, "free_while_shared") as fault:
            bad = serve(engine)
        print("freed while shared (step, page, refcount it had):", fault.forced, "\\n")
        for k, o in bad.items():
            print(f"{k} (request {o.request_id}, {o.num_cached_tokens} prompt tokens from the prefix cache): {o.text!r}")
        faulty_scans = wb.probe("page_table").frame()
    """),
    md("""
        B, the request that hit the prefix cache, answers nonsense, and it tends to echo C's prompt: it
        now reads C's K/V where its policy text was. A and C look fine.

        ## 3. What the probe found
        The probe checks each freed page against the live page tables (*freed while mapped*), and after
        every step scans the live tables against the pool: refcount against the number of tables mapping
        each page, and each page's generation (bumped on every allocation) against the one the sequence
        got (*page reused*: someone else's KV now lives there).
    """),
    code("""
        caught = wb.all_findings()        # Finding objects (kept: wb.reset() below clears the probes)
        found = wb.findings
        found[["severity", "kind", "step", "request_id", "page", "message"]]
    """),
    md("""
        **The view.** The probe's per-step scan: pages shared by two live requests, and the pages the
        scan found mapped-but-free, with a missing reference, or reused under a live request. Sharing
        ends the moment A finishes, yet B keeps reading those pages; C is handed them next.
    """),
    code("""
        cols = ["shared_pages", "free_while_mapped", "refcount_missing", "reused"]
        px.line(faulty_scans, x="step", y=cols, markers=True, height=320,
                labels={"value": "pages", "variable": "page_table scan"},
                title="free_while_shared: B's prefix pages are freed under it, then handed to C")
    """),
    md("""
        ## 4. Root cause
        Prefix sharing makes one physical page belong to several sequences, so a page may go back to
        the free queue only when its *last* user lets go. The faulty free path returned A's prefix pages
        on A's finish although B still mapped them (refcount 2). The pool handed them to C; C's prefill
        overwrote them with its own K/V; B kept reading them through its block table and attended over
        C's poem instead of the policy. Requests without a cache hit own all their pages, so only cache
        hits break.
    """),
    catalogue_row("free_while_shared"),
    md("""
        The correct free path: one reference dropped per call, a page freed only at zero (every prefix
        hit takes its reference with `PagePool.acquire`).
    """),
    code("""
        print(inspect.getsource(PagePool.free))
    """),
    md("""
        ## 5. The fix, and the same workload clean
        Outside the with-block the refcounted `free` is back. The pool the fault left is whole (every page
        free, no reference left), and the same workload runs clean with the probe still attached.
    """),
    code("""
        assert engine.pool.num_free == engine.pool.num_pages and not any(engine.pool.ref)
        wb.reset()
        good = serve(engine)
        pd.DataFrame({"request": list(good), "refcount dropped": [bad[k].text for k in good],
                      "refcounted free": [good[k].text for k in good]})
    """),
    code("""
        px.line(wb.probe("page_table").frame(), x="step", y=cols, markers=True, height=280,
                labels={"value": "pages", "variable": "page_table scan"},
                title="fixed: B holds its shared pages until it finishes; nothing is reused under it")
    """),
    md("## 6. Checks: the diagnosis still works"),
    code("""
        b = bad["B"].request_id
        shared = sorted(p for _, p, _ in fault.forced)
        assert bad["B"].num_cached_tokens >= 64 and len(shared) >= 4        # B hit A's cached prefix
        errors = [f for f in caught if f.severity in ("error", "critical")]
        first = errors[0]
        assert first.kind == "free-while-mapped" and first.request_id == b and first.page in shared
        kinds = {f.kind for f in errors if f.request_id == b and f.page in shared}
        assert {"free-while-mapped", "refcount", "page-reused"} <= kinds
        # The symptom, only on the prefix-cache hit.
        assert bad["B"].token_ids != good["B"].token_ids
        assert bad["A"].token_ids == good["A"].token_ids and bad["C"].token_ids == good["C"].token_ids
        # The fix clears it: B still hits the cache, nothing is freed under it.
        assert good["B"].num_cached_tokens >= 64
        assert wb.findings_at_least("warn") == []
        wb.detach()
    """),
]


# ---- cu_seqlens_corrupt -----------------------------------------------------------------------
CU = [
    md("""
        # cu_seqlens corrupt: attention over the wrong span, and no error

        **What production saw** (field note 4): *"cu_seqlens wrong: must start at 0, be non-decreasing
        (strictly, with no empty sequences), end at the total token count, be int32 and contiguous on
        the device. Otherwise attention silently covers the wrong span. FlashAttention checks only dtype
        and device; FlashInfer skips the checks to avoid a device sync."*

        Here: corrupt one packed batch's `cu_seqlens`, watch two answers go wrong with nothing raised,
        let the `cu_seqlens` probe name the rule, the batch index and the request, and run clean again.
    """),
    SETUP,
    md("""
        ## 1. Reproduce: two entries swapped after packing
        A packed batch puts every sequence's query tokens in one buffer; `cu_seqlens_q[i]..[i+1]` says
        which tokens are sequence *i*'s. `faults.inject(engine, "cu_seqlens_corrupt", mode="swap",
        index=1)` swaps entries 1 and 2 of one decode batch, in the device tensor and in the host copy
        the attention backend plans from: rows 1 and 2 trade queries, each attending over the other's
        pages for one step.
    """),
    code("""
        wb = Workbench(engine).attach("cu_seqlens")
        with faults.inject(engine, "cu_seqlens_corrupt", mode="swap", index=1) as fault:
            garbled = engine.generate(prompts, params)
        print("corrupted:", fault.corrupted, "\\n")
        for q, o in zip(questions, garbled):
            print(f"Q: {q}\\nA: {o.text!r}\\n")
    """),
    md("""
        ## 2. What the probe found
        On every `BatchPacked` event the probe runs the rules a varlen kernel assumes (int32, contiguous,
        on the query's device, B+1 entries, starts at 0, increasing, ends at the token total, each span
        equal to the scheduled length, `max_seqlen` the longest span) and names the first bad segment:
        its batch index and request.
    """),
    code("""
        caught = wb.all_findings()        # Finding objects (kept: wb.reset() below clears the probes)
        found = wb.findings
        found[["severity", "kind", "step", "request_id", "message"]]
    """),
    code("""
        wb.probe("cu_seqlens").frame()
    """),
    md("""
        **The view.** The span of the packed buffer each sequence's attention covered at that step, as
        scheduled (from the query lengths) and as the corrupted `cu_seqlens_q` told the kernel. A span
        that runs backwards or covers a neighbour's token is attention over the wrong tokens.
    """),
    code("""
        import numpy as np

        bad = next(f for f in caught if f.severity == "error" and f.evidence["tensor"] == "cu_seqlens_q")
        ev = bad.evidence
        told, lengths = np.array(ev["values"]), np.array(ev["lengths"])
        meant = np.concatenate([[0], np.cumsum(lengths)])
        spans = pd.DataFrame(
            [{"request": str(r), "cu_seqlens": which, "start": int(c[i]), "tokens": int(c[i + 1] - c[i])}
             for which, c in (("scheduled", meant), ("what the kernel was told", told))
             for i, r in enumerate(ev["request_ids"])])
        px.bar(spans, y="request", x="tokens", base="start", color="cu_seqlens", barmode="group",
               orientation="h", height=300, labels={"tokens": "position in the packed buffer"},
               title=f"step {bad.step}: cu_seqlens_q {told.tolist()}, scheduled {meant.tolist()}")
    """),
    md("""
        The probe names batch index 0 first: the corrupted tensor gives sequence 0 two tokens. The torch
        reference plans decode rows by their start offsets, so here only rows 1 and 2 changed; a fused
        varlen kernel would also have run sequence 0's attention over its neighbour's query.

        The probe's rules are plain functions: run them on any tensor, e.g. the one above, or on
        torch_npu's `actual_seq_lengths` (`check_actual_seq_lengths`, cumulative ends without the 0).
    """),
    code("""
        import torch
        from probes.cu_seqlens import check_cu_seqlens

        check_cu_seqlens(torch.tensor(told, dtype=torch.int32), int(lengths.sum()), lengths=lengths.tolist())
    """),
    md("""
        ## 3. Root cause
        `cu_seqlens` was edited after packing, and the kernel trusted it: nothing checks that it is
        monotone or matches the lengths that were packed, so the attention of rows 1 and 2 ran over the
        wrong tokens and wrote the result into the other sequence's output rows. One step of that is
        enough: the wrong token is sampled and fed back, and the answer drifts from there. In production
        the same comes from a buffer refilled late or from a stale, reused tensor.
    """),
    catalogue_row("cu_seqlens_corrupt"),
    md("""
        ## 4. The fix: build cu_seqlens once per step and never touch it
        The batch builder computes it as a cumulative sum of the query lengths into a preallocated int32
        buffer; with the fault's edit gone (the with-block's end), the same prompts answer normally and
        the probe, still attached, stays quiet.
    """),
    code("""
        wb.reset()
        fixed = engine.generate(prompts, params)
        pd.DataFrame({"question": questions, "cu_seqlens swapped": [o.text for o in garbled],
                      "cu_seqlens as packed": [o.text for o in fixed]})
    """),
    code("""
        wb.findings_at_least("warn")
    """),
    md("## 5. Checks: the diagnosis still works"),
    code("""
        [c] = fault.corrupted
        errors = [f for f in caught if f.severity in ("error", "critical")]
        assert errors and all(f.step == c["step"] for f in errors)
        by_rule = {f.evidence["rule"]: f for f in errors}
        assert by_rule["decreasing"].evidence["index"] == c["entry"]           # the swapped entry
        first = min(errors, key=lambda f: f.evidence["index"])                  # the first bad segment
        assert first.evidence["index"] == c["first_bad"] and first.request_id == c["request_id"]
        assert ev["values"] == c["after"]
        # The symptom: rows 1 and 2 traded queries for one step; row 0 did not.
        assert garbled[0].token_ids == fixed[0].token_ids
        assert garbled[1].token_ids != fixed[1].token_ids and garbled[2].token_ids != fixed[2].token_ids
        # The fix clears it.
        assert "Paris" in fixed[0].text and wb.findings_at_least("warn") == []
        assert wb.probe("cu_seqlens").batches_checked > 0
        wb.detach()
    """),
]


# ---- fp16_kv_overflow ------------------------------------------------------------------------
FP16 = [
    md("""
        # FP16 KV overflow: `<unk>` and garbage from a larger model

        **What production saw** (field note 5): *"FP16 overflow: a larger model (Qwen-7B) produced
        `<unk>` and garbage while a small one was fine and training loss looked perfect: some layers'
        K/V exceed 65504 and become inf. Fix reported: a scale per page (absmax-based, stored with the
        page, applied on write, undone on read): accuracy 63% -> 99.2%."* Public: vllm #14126 (Qwen,
        "!!!!!!" in fp16), vllm #40290, vllm-ascend #6332.

        Here: the default model with a float16 KV cache answers fine; give one layer the large K/V of
        the bigger model and it answers nothing; the `fp16_overflow` probe names the layer, page and
        request; the per-page scaled cache (`kv_cache_dtype="fp16_scaled"`) answers right again.
    """),
    code("""
        import pandas as pd
        import plotly.express as px
        from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults

        pd.set_option("display.max_colwidth", None)
        questions = ["What is the capital of France?", "Name three primary colours."]
        prompts = [[{"role": "user", "content": q}] for q in questions]
        params = SamplingParams(max_tokens=16, temperature=0.0)

        engine = Engine.from_default(EngineConfig(num_pages=64, kv_cache_dtype="float16"))
        wb = Workbench(engine).attach("fp16_overflow")          # measures every 4th step
        healthy = engine.generate(prompts, params)
        for q, o in zip(questions, healthy):
            print(f"Q: {q}\\nA: {o.text!r}\\n")
    """),
    md("""
        The small model's K/V sit far below 65504, so the float16 cache holds them: the answers are
        right and the probe is silent.

        ## 1. Reproduce: one layer with a larger model's K/V
        `faults.inject(engine, "fp16_kv_overflow")` scales the middle layer's (15 of 30) `k_proj` and
        `v_proj` up by a power of two and its `q_proj` / `o_proj` down by the same factor: in float32
        the model computes exactly the same function, but that layer's K/V now exceed fp16's range, as
        in the bigger model. Only the cast into the float16 KV cache breaks.
    """),
    code("""
        with faults.inject(engine, "fp16_kv_overflow") as fault:
            broken = engine.generate(prompts, params)
        print(f"layer {fault.layer}: K/V x {fault.factor:g}\\n")
        for q, o in zip(questions, broken):
            shown = engine.tokenizer.decode(o.token_ids, skip_special_tokens=False)
            print(f"Q: {q}\\nA: {o.text!r}   tokens {o.token_ids} = {shown!r}\\n")
    """),
    md("""
        The answers are empty: every token is id 0, `<|endoftext|>` (this vocabulary's `<unk>`): the
        cache stored inf, attention over inf returned NaN, NaN logits, argmax 0.

        ## 2. What the probe found
        Before each KV write, the probe measures per layer the absmax of K, V and the hidden state against
        65504, and any inf/NaN, and names the first layer of the step with a problem, the page and the
        request of the first offending token. In a plain float16 cache, K/V over 65504 is an error.
    """),
    code("""
        found = wb.findings
        found[["severity", "kind", "step", "layer", "request_id", "page", "message"]]
    """),
    code("""
        over = next(f for f in wb.findings_at_least("error") if f.kind == "fp16-kv-overflow")
        print(over.message, "\\nhint:", over.hint)
    """),
    md("""
        **The view.** The probe's frame: K/V absmax per layer over fp16's limit (1.0 = 65504), on the
        first measured step under the fault. One layer is about twenty times past the limit; the rest are far
        below it. `wb.probe("fp16_overflow").widget()` draws the same per layer and step as a heatmap.
    """),
    code("""
        df = wb.probe("fp16_overflow").frame()
        at = df[df.step == over.step]
        fig = px.bar(at, x="layer", y="kv_headroom", log_y=True, height=320,
                     labels={"kv_headroom": "K/V absmax / 65504"},
                     title=f"step {over.step}: K/V headroom per layer (float16 KV cache)")
        fig.add_hline(y=1.0, line_dash="dash", annotation_text="fp16 max 65504")
        fig
    """),
    md("""
        ## 3. Root cause
        float16 tops out at 65504. Large models have layers whose keys and values are large (outlier
        channels); training in bf16 or fp32 never notices, so the loss looks perfect. Cast into a float16
        KV cache they become inf; the scores over them are inf or NaN, the softmax is NaN, and from that
        layer on every hidden state is NaN. A small model is fine only because its K/V happen to be small.
    """),
    catalogue_row("fp16_kv_overflow"),
    md("""
        ## 4. The fix: a scale per page
        `kv_cache_dtype="fp16_scaled"` keeps float16 pages (the same memory) with a scale per page: on
        write, values are divided by the page's absmax-based scale; on read, multiplied back. Same model,
        same fault, new engine:
    """),
    code("""
        fixed_engine = Engine.from_default(EngineConfig(num_pages=64, kv_cache_dtype="fp16_scaled"))
        wb_fixed = Workbench(fixed_engine).attach("fp16_overflow")
        with faults.inject(fixed_engine, "fp16_kv_overflow") as fixed_fault:
            fixed = fixed_engine.generate(prompts, params)
        pd.DataFrame({"question": questions, "float16 KV, before": [o.text for o in healthy],
                      "float16 KV, large K/V": [o.text for o in broken],
                      "fp16_scaled KV, large K/V": [o.text for o in fixed]})
    """),
    code("""
        wb_fixed.findings[["severity", "kind", "layer", "message"]]     # info only: the scales absorbed it
    """),
    md("## 5. Checks: the diagnosis still works"),
    code("""
        errors = wb.findings_at_least("error")
        assert {"fp16-kv-overflow", "fp16-nonfinite"} <= {f.kind for f in errors}
        assert all(f.layer == fault.layer for f in errors)
        assert over.evidence["k_absmax"] > 65504 and "fp16_scaled" in over.hint
        assert at.set_index("layer")["kv_headroom"].idxmax() == fault.layer
        # The symptom: token 0 instead of the answer; the healthy run was silent.
        assert "Paris" in healthy[0].text and "Paris" not in broken[0].text
        assert all(0 in o.token_ids for o in broken)
        # The fix clears it: the same large K/V, answered right, nothing above info.
        assert fixed_fault.layer == fault.layer
        assert "Paris" in fixed[0].text and all(o.text.strip() and 0 not in o.token_ids for o in fixed)
        assert wb_fixed.findings_at_least("warn") == []
        assert any(f.kind == "fp16-kv-overflow" and f.severity == "info" for f in wb_fixed.all_findings())
        wb.detach(); wb_fixed.detach()
    """),
]


NOTEBOOKS_A = {"stale_binding": STALE, "page_out_of_range": OOR, "free_while_shared": FWS,
               "cu_seqlens_corrupt": CU, "fp16_kv_overflow": FP16}


if __name__ == "__main__":
    for name, cells in NOTEBOOKS_A.items():
        print(write(name, cells).relative_to(ROOT))
