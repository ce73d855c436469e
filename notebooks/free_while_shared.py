# %% [markdown]
# # Free while shared: garbage only on prefix-cache hits
#
# **What production saw** (field note 3): *"Missing refcount with prefix sharing: one request
# finishes, frees pages another request still reads; they are reallocated; the survivor reads
# someone else's KV. Symptom: garbage only on prefix-cache hits"* (public: vllm #7003, vllm-ascend
# #5269, Qwen2.5 garbled on prefix-cache hit).
#
# Here: two requests share a document as a prompt prefix, the first one finishes, a stranger
# arrives; with the refcount dropped, the survivor answers garbage. The `page_table` probe names
# the pages, the request and the step; then the fix and a clean run.

# %%
import inspect
import pandas as pd
import plotly.express as px
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.engine.pages import PagePool
from workbench.lab import show_fault

pd.set_option("display.max_colwidth", None)

# A tight pool (8 pages of 16 tokens), as in production under load: a stranger's pages come
# from the ones just freed.
engine = Engine.from_default(EngineConfig(num_pages=8))

# %% [markdown]
# ## 1. The workload: a shared prefix, then a stranger
# A and B ask about the same refund policy, so B's prompt starts with the same 64 tokens (4 full
# pages) as A's: a prefix-cache hit, B maps A's pages. A finishes after two tokens. Then C, about
# something else, arrives and needs pages.

# %%
POLICY = ("Our store's refund policy: items can be returned within 30 days of delivery for a full refund. "
          "Sale items can only be exchanged. Shipping costs are refunded only when the item arrived damaged.")
A = [{"role": "user", "content": POLICY + "\n\nHow many days do I have to return an item?"}]
B = [{"role": "user", "content": POLICY + "\n\nWhat does the policy say about sale items?"}]
C = [{"role": "user", "content": "Write a short poem about the moon and the stars over the quiet sea at "
      "night. The poem should mention a lighthouse, a small fishing boat, the smell of salt and the sound "
      "of waves on the rocks, and end with the sunrise."}]

def serve(engine):
    """A arrives; B (same prefix) one step later; C once A has finished. Returns {name: output}."""
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


# %% [markdown]
# ## 2. Reproduce: the free path ignores the refcount
# `faults.inject(engine, "free_while_shared")` makes `PagePool.free` release a page even when
# another sequence still holds a reference to it. The workload runs to completion inside the
# with-block (a request still live at exit would map pages the fault already gave away).

# %%
wb = Workbench(engine).attach("page_table")
with faults.inject(engine, "free_while_shared") as fault:
    bad = serve(engine)
print("freed while shared (step, page, refcount it had):", fault.forced, "\n")
for k, o in bad.items():
    print(f"{k} (request {o.request_id}, {o.num_cached_tokens} prompt tokens from the prefix cache): {o.text!r}")
faulty_scans = wb.probe("page_table").frame()

# %% [markdown]
# B, the request that hit the prefix cache, answers nonsense, and it tends to echo C's prompt: it
# now reads C's K/V where its policy text was. A and C look fine.
#
# ## 3. What the probe found
# The probe checks each freed page against the live page tables (*freed while mapped*), and after
# every step scans the live tables against the pool: refcount against the number of tables mapping
# each page, and each page's generation (bumped on every allocation) against the one the sequence
# got (*page reused*: someone else's KV now lives there).

# %%
caught = wb.all_findings()        # Finding objects (kept: wb.reset() below clears the probes)
found = wb.findings
found[["severity", "kind", "step", "request_id", "page", "message"]]

# %% [markdown]
# **The view.** The probe's per-step scan: pages shared by two live requests, and the pages the
# scan found mapped-but-free, with a missing reference, or reused under a live request. Sharing
# ends the moment A finishes, yet B keeps reading those pages; C is handed them next.

# %%
cols = ["shared_pages", "free_while_mapped", "refcount_missing", "reused"]
px.line(faulty_scans, x="step", y=cols, markers=True, height=320,
        labels={"value": "pages", "variable": "page_table scan"},
        title="free_while_shared: B's prefix pages are freed under it, then handed to C")

# %% [markdown]
# ## 4. Root cause
# Prefix sharing makes one physical page belong to several sequences, so a page may go back to
# the free queue only when its *last* user lets go. The faulty free path returned A's prefix pages
# on A's finish although B still mapped them (refcount 2). The pool handed them to C; C's prefill
# overwrote them with its own K/V; B kept reading them through its block table and attended over
# C's poem instead of the policy. Requests without a cache hit own all their pages, so only cache
# hits break.

# %%
show_fault("free_while_shared")

# %% [markdown]
# The correct free path: one reference dropped per call, a page freed only at zero (every prefix
# hit takes its reference with `PagePool.acquire`).

# %%
print(inspect.getsource(PagePool.free))

# %% [markdown]
# ## 5. The fix, and the same workload clean
# Outside the with-block the refcounted `free` is back. The pool the fault left is whole (every page
# free, no reference left), and the same workload runs clean with the probe still attached.

# %%
assert engine.pool.num_free == engine.pool.num_pages and not any(engine.pool.ref)
wb.reset()
good = serve(engine)
pd.DataFrame({"request": list(good), "refcount dropped": [bad[k].text for k in good],
              "refcounted free": [good[k].text for k in good]})

# %%
px.line(wb.probe("page_table").frame(), x="step", y=cols, markers=True, height=280,
        labels={"value": "pages", "variable": "page_table scan"},
        title="fixed: B holds its shared pages until it finishes; nothing is reused under it")

# %% [markdown]
# ## 6. Checks: the diagnosis still works

# %%
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
