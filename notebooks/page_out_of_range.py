# %% [markdown]
# # Page id out of range: one request answers NaN, zeros or nothing
#
# **What production saw** (field note 2): *"Out-of-range page ids: kernels read illegal addresses;
# outputs all zeros or NaN. Check every id in [0, num_pages). Ascend kernels do not validate block
# ids."* On a card the same bug can also end in an illegal-memory-access crash.
#
# Here: put one bad id in the bound block table, watch one request break while the others answer,
# let the `page_table` probe name the request, the row, the column and the id, and run clean again.

# %%
import pandas as pd
import plotly.express as px
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import QUESTIONS, answers, chat, show_fault

pd.set_option("display.max_colwidth", None)                  # show whole answers and messages
engine = Engine.from_default(EngineConfig(num_pages=64))     # SmolLM2-135M-Instruct, 16-token pages
questions = QUESTIONS                                        # France's capital, three colours, 12 x 12
prompts = chat(questions)                                    # one user message each
params = SamplingParams(max_tokens=24, temperature=0.0)       # greedy: any change is the fault's

# %% [markdown]
# ## 1. Reproduce: one id past the pool in the bound table
# `faults.inject(engine, "page_out_of_range", row=1)` writes `num_pages` (the first id past the
# pool) into the newest column of batch row 1 of the bound device table, for one step. torch on a
# CPU checks indices and would raise instead; to show what the device did, the fault models the
# memory past the pool as NaN (`fill="zeros"` models zeroed memory; `unchecked=False` keeps the
# bounds check, the IndexError standing in for the crash).
#
# A small listener keeps the table each step's kernel reads, for the view below.

# %%
from workbench.events import BatchPacked

tables = {}                       # step -> (request ids, the bound block table the kernel reads)
keep = lambda e: tables.__setitem__(e.step, (e.request_ids, engine.last_batch.block_tables.tolist()))
engine.bus.subscribe(BatchPacked, keep)

wb = Workbench(engine).attach("page_table")
with faults.inject(engine, "page_out_of_range", row=1) as fault:
    broken = engine.generate(prompts, params)
engine.bus.unsubscribe(keep)
print("corrupted:", fault.corrupted, "\n")
for q, o in zip(questions, broken):
    print(f"Q: {q}\nA: {o.text!r}  (tokens {o.token_ids[:6]}..., {o.finish_reason})\n")

# %% [markdown]
# One answer breaks off after its first word, and every token after it is id 0, `<|endoftext|>`:
# its attention read NaN from past the pool, the logits became NaN and argmax picked token 0. The
# NaN hidden state was also written into the request's own KV pages, so it never recovers, though
# the bad id was there for one step only. The other requests are untouched, which is what made this
# hard to find in production.
#
# ## 2. What the probe found
# Once per forward, before any page is read, the probe checks every id the kernel will read in
# the bound block table against `[0, num_pages)`.

# %%
found = wb.findings
found[["severity", "kind", "step", "request_id", "page", "message"]]

# %%
hit = wb.findings_at_least("error")[0]
print(hit.message, "\nhint:", hit.hint)
hit.evidence

# %% [markdown]
# **The view.** The block table the kernel read at that step: one row per request, one column per
# page, the colour the page id. Every id should be below the pool size; one is not.

# %%
rids, table = tables[hit.step]
fig = px.imshow(table, text_auto=True, color_continuous_scale="Reds", aspect="auto",
                labels={"x": "page column", "y": "request", "color": "page id"},
                y=[str(r) for r in rids], height=260,
                title=f"step {hit.step}: the bound block table (pool: pages 0..{engine.num_pages - 1})")
fig

# %% [markdown]
# ## 3. Root cause
# The paged kernels (Ascend paged attention, `flash_attn_with_kvcache`) trust the block table:
# an id `>= num_pages` makes them read whatever lies past the KV pool (other allocations, freed
# memory: NaN or zeros) or fault. The id itself comes from elsewhere: a table sized for another
# pool, an unmasked padding id, an id from another card's pool. The probe names the row and column,
# so the writer of that entry is the one to find.

# %%
show_fault("page_out_of_range")

# %% [markdown]
# ## 4. The fix: only ids inside the pool reach the kernel
# With the writer of the bad id fixed (here: the with-block's end undoes it), the same prompts
# answer normally and the probe, still attached, stays quiet. Keep the `[0, num_pages)` check at
# bind time in debug builds: it costs one pass over `B x W` ints.

# %%
wb.reset()
fixed = engine.generate(prompts, params)
answers(questions, {"id past the pool": broken, "ids in range": fixed})

# %%
wb.findings_at_least("warn")

# %% [markdown]
# ## 5. Checks: the diagnosis still works

# %%
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
