# %% [markdown]
# # Stale binding: garbled text once the page table changes
#
# **What production saw** (field note 1, Ascend 910B): *"the page table was updated, but the kernel
# was launched with the old binding (the re-bind call had drifted to after the kernel launch in a
# refactor). Symptom: garbled text, first step after growth reads old pages."* The diagnosis that
# worked: *compare the table version the kernel consumed with the current one.*
#
# Here: reproduce it on the default model, let the `page_table` probe name the request and page,
# see why it happens, apply the fix and run clean again.

# %%
import pandas as pd
import plotly.express as px
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import QUESTIONS, answers, chat, show_answers, show_fault

pd.set_option("display.max_colwidth", None)                  # show whole answers and messages
engine = Engine.from_default(EngineConfig(num_pages=64))     # SmolLM2-135M-Instruct, 16-token pages
questions = QUESTIONS                                        # France's capital, three colours, 12 x 12
prompts = chat(questions)                                    # one user message each
params = SamplingParams(max_tokens=24, temperature=0.0)       # greedy: any change is the fault's

# %% [markdown]
# ## 1. Reproduce: the re-bind after the kernel launch
# `faults.inject(engine, "stale_binding")` moves `BlockTables.bind()` from before `model.forward` to
# after it, as the refactor did. The `page_table` probe watches, and so does the `attention` check
# (section 2b). The whole generation runs inside the with-block: on exit the fault drops the
# prefix-cache entries it poisoned.

# %%
wb = Workbench(engine).attach("page_table", "attention")
with faults.inject(engine, "stale_binding") as fault:
    garbled = engine.generate(prompts, params)
print(f"{fault.late_binds} forwards ran before their block table was bound\n")
show_answers(questions, garbled, quote=True)

# %% [markdown]
# ## 2. What the probe found
# For every forward, the probe compares the block-table version each attention kernel read
# (`AttentionRead.block_table_version`) with the version current for the step
# (`BlockTables.host_version`). When they differ it compares the rows the kernel read with the
# page tables and names each request that read a page it does not own.

# %%
caught = wb.all_findings()        # Finding objects (kept: wb.reset() below clears the probes)
found = wb.findings
found[["severity", "kind", "step", "request_id", "page", "message"]]

# %% [markdown]
# The first error, in detail: the row of the block table the kernel read, against the row the
# page table means at that step.

# %%
first = next(f for f in caught if f.kind == "stale-binding" and f.severity == "error")
ev = first.evidence
print(f"step {first.step}, request {first.request_id}: version read {ev['version_read']}, "
      f"current {ev['version_current']}\nhint: {first.hint}")
pd.DataFrame({"kernel read": ev["row_read"], "page table": ev["row_meant"]},
             index=[f"page {i}" for i in range(len(ev["row_read"]))]).T

# %% [markdown]
# **The view.** From the event log: the steps in which the table changed (a request got pages, or
# one finished and the rows below it moved up) and the steps in which the probe caught a stale
# read. The stale reads sit on the steps right where the table changed: the kernel still held
# the previous step's rows.

# %%
log = wb.log
changed = pd.concat([
    log.frame("PagesAllocated").assign(event="got pages (admitted or grew)"),
    log.frame("RequestFinished").assign(event="finished (rows below move up)"),
    found[found.kind == "stale-binding"].assign(event="stale read (page_table probe)"),
])[["step", "request_id", "event"]].dropna()
px.scatter(changed, x="step", y=changed["request_id"].astype(int).astype(str), color="event",
           symbol="event", labels={"y": "request"}, height=320,
           title="stale_binding: the kernel reads the previous step's table")

# %% [markdown]
# ## 2b. The same bug, seen from the math
# The `attention` probe knows nothing of table versions. Every forward it takes one layer and one
# request row, recomputes float32 attention of the layer's own q over the K/V stored in that
# request's own pages, and compares it with what the kernel produced. Here they differ, and of the
# explanations it tries (a mask off by one, another scale, another KV head, a page left out, the
# pages the batch's block table names) the last one reproduces the kernel's output exactly.
#
# The picture is that finding's row: per query head, the attention weights the model means (over the
# request's own pages) against the weights that reproduce the kernel's output (over the pages the
# stale table named). Grey lines are page boundaries: the weights part ways on the pages that moved.

# %%
math = [f for f in caught if f.kind == "attention-read" and f.evidence.get("explanation") == "block-table"]
seen = math[0]
print(f"step {seen.step}, request {seen.request_id}, layer {seen.layer}:\n{seen.message}")
wb.probe("attention").figure(seen)

# %% [markdown]
# ## 3. Root cause
# Every step the batch builder stages the new page lists in a host buffer (a new *current*
# version) and `bind()` publishes them to the device buffer the kernels read. With the bind after
# the launch, each forward reads the previous step's table. That is harmless while no row
# changes, which is why it survived testing; but on the first step in which a sequence grows a
# page, a request joins, or one leaves and the rows shift, the kernel reads a padding 0 or another
# sequence's page. Paged-attention kernels do not check whose page it is: the request attends over
# someone else's KV and answers garbage.

# %%
show_fault("stale_binding")

# %% [markdown]
# ## 4. The fix: bind before the launch
# The engine's own step binds in `BatchBuilder.build(bind=True)`, before `model.forward`; leaving
# the with-block restores exactly that order. Same prompts, probe still on:

# %%
wb.reset()
fixed = engine.generate(prompts, params)
answers(questions, {"stale binding": garbled, "bind before launch": fixed})

# %%
wb.findings_at_least("warn")      # nothing: the versions match on every step

# %% [markdown]
# ## 5. Checks: the diagnosis still works

# %%
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
