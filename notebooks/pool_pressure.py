# %% [markdown]
# # pool_pressure: preemption storms and OOM on long-tail traffic
#
# **What production saw** (field note 10): the KV pool was sized from the wrong length. The rule that fixed it:
# *"max_pages = ceil(batch x P99 length / page_size) x 1.3. Size from production's P99 length, not the training
# max_len: a service with max_len 2048 but 99% of requests under 512 needs 2,048 pages, not 16,384 (1.1 GB saved,
# table set-up 4.7x faster)."* Sized too small instead, the long tail fills the pool: the scheduler preempts and
# recomputes request after request, or stalls outright (the OOM). Operators alert at *used ratio > 0.95*
# (field note 13).
#
# Here the fault takes pages out of the live pool, so only 15% of it is left to requests, and long-tail chat
# traffic runs on it. The pool probe names the pressure and computes the size from what it saw.

# %%
import pandas as pd
import plotly.express as px

from probes.pool import advise_pool_size
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import PARAGRAPH, chat, show_fault

pd.set_option("display.max_colwidth", 160)

# %%
show_fault("pool_pressure")

# %% [markdown]
# ## 1. The engine and long-tail traffic
# SmolLM2-135M-Instruct with a 128-page pool of 16 tokens.
#
# `num_threads=1`: one torch thread. On a small shared machine two OpenMP threads spin against each other and every step gets many times slower; SmolLM2-135M loses little without the second.
#
# Sixteen chat requests at once: fourteen
# short questions and a tail of two that paste two and four paragraphs to summarise.

# %%
short = ["What is the capital of France?", "Name three primary colours.", "Write one sentence about the sea.",
         "What is the largest ocean on Earth?", "What colour is the sky on a clear day?",
         "Give me a synonym for happy.", "How many legs does a spider have?", "What is the boiling point of water?",
         "Name a fruit that is yellow.", "What language is spoken in Brazil?", "Who wrote Romeo and Juliet?",
         "What is the opposite of cold?", "Name a mammal that can fly.", "How many days are in a week?"]
questions = short + ["Summarise in one sentence: " + PARAGRAPH * k for k in (2, 4)]     # the long tail
prompts = chat(questions)
params = SamplingParams(max_tokens=32, temperature=0.0)

engine = Engine.from_default(EngineConfig(num_pages=128, num_threads=1))
engine.generate(["Hello"], SamplingParams(max_tokens=1))      # loads the tokenizer, warms up
lengths = [len(engine.tokenizer.apply_chat_template(p)) for p in prompts]
print("prompt lengths (tokens):", lengths)

# %% [markdown]
# ## 2. The symptom: preemptions
# With the fault on, 15% of the pool is usable. Every request still gets an answer, but the scheduler admits by
# free pages, the running requests grow as they decode, and whenever the next page is missing the newest request
# is preempted and later recomputed from scratch.

# %%
wb = Workbench(engine).attach("pool", pool={"storm_threshold": 3})
with faults.inject(engine, "pool_pressure", usable=0.15) as fault:
    usable = engine.pool.num_free
    pressured = engine.generate(prompts, params)          # runs to completion inside the with-block
print(f"{usable} of {engine.num_pages} pages usable; {engine.stats()['num_preemptions']} preemptions")
pd.DataFrame({"prompt tokens": lengths, "preemptions": [o.num_preemptions for o in pressured],
              "answer": [o.text.strip()[:70] for o in pressured]})

# %% [markdown]
# Which requests were preempted, and when (`wb.log.frame("RequestPreempted")`; the probe is set to call three
# preemptions within 16 steps a storm, for a demo this small):

# %%
wb.log.frame("RequestPreempted")[["step", "request_id"]]

# %% [markdown]
# ## 3. The findings
# Usage above the 0.95 alert for three steps is an error whose hint is the sizing rule applied to the traffic seen
# so far; a burst of preemptions is a storm; pages held outside every live sequence (the part of the pool the fault
# took) are named too.

# %%
wb.findings[["probe", "severity", "kind", "step", "request_id", "message"]]

# %%
caught = {f.kind: f for f in wb.findings_at_least("error")}
print(caught["pool-usage"].message)
print("\nhint:", caught["pool-usage"].hint)


# %% [markdown]
# ## 4. The view: pool usage and preemptions per step
# From `wb.probe("pool").frame()`: used share of the pool against the 0.95 alert line, and the steps with
# preemptions.

# %%
def pool_view(df, title):
    fig = px.line(df, x="step", y="usage", title=title, range_y=[0, 1.05],
                  hover_data=["pages_used", "pages_total", "live_seqs", "waiting"])
    fig.add_hline(y=0.95, line_dash="dash", line_color="crimson", annotation_text="alert 0.95")
    hit = df[df["preemptions"] > 0]
    fig.add_scatter(x=hit["step"], y=hit["usage"], mode="markers", name="preemption",
                    marker=dict(color="crimson", size=11, symbol="x"))
    return fig


pressure = wb.probe("pool").frame()
pool_view(pressure, "15% of the pool usable: usage and preemptions")

# %% [markdown]
# ## 5. Root cause
# The pool was sized for a typical request, not for the tail. Paged KV allocates pages on demand, so short requests
# fit many at once, but a few long prompts take most of the pool, and every running request needs a new page every
# 16 tokens it generates. With no headroom the scheduler's only move is to preempt (free the newest request's pages
# and recompute it later): throughput goes to recomputation, and a request longer than the usable pool can never
# run at all (the OOM).
#
# ## 6. The fix: size the pool from production's P99 length
# `ceil(batch x P99 length / page_size) x 1.3`. The probe applies the rule to the lengths the requests reached and
# the most requests that were in flight at once; `advise_pool_size` is the rule itself. (The finding's hint applied
# it at the moment of the alert, to the requests running then; the long tail was still queued. Now the probe has
# seen the whole traffic.)

# %%
advice = wb.probe("pool").sizing()
rule = advise_pool_size([n + params.max_tokens for n in lengths], max_batch=len(prompts), page_size=16)
print(advice)
print("the rule over prompt + max_tokens for all", len(prompts), "requests at once:", rule, "pages")

# %% [markdown]
# A pool of the advised size, the same traffic:

# %%
fixed = Engine.from_default(EngineConfig(num_pages=advice["pages"], num_threads=1))
fixed.tokenizer = engine.tokenizer         # the same model file: reuse the tokenizer already loaded
wb_fixed = Workbench(fixed, log=False).attach("pool", pool={"storm_threshold": 3})
fixed_outs = fixed.generate(prompts, params)
sized = wb_fixed.probe("pool").frame()
print(f"{fixed.num_pages} pages: {fixed.stats()['num_preemptions']} preemptions, peak usage {sized['usage'].max():.0%}")
print("answers unchanged:", [o.text for o in fixed_outs] == [o.text for o in pressured])
pool_view(sized, f"advised pool ({fixed.num_pages} pages): usage")

# %%
wb_fixed.findings

# %% [markdown]
# ## 7. Checks
# The pressure is caught as an error over the 0.95 alert with the sizing hint, preemptions really happened (and
# recompute kept every answer right), the pages went back when the fault was switched off, and the advised pool
# runs the same traffic without a preemption or a finding.

# %%
usage = caught["pool-usage"]
assert usage.probe == "pool" and usage.severity == "error" and usage.evidence["usage"] > 0.95
assert "EngineConfig(num_pages=" in usage.hint and f"{usable} of them usable" in usage.hint
assert sum(o.num_preemptions for o in pressured) > 0 and pressure["preemptions"].sum() > 0
assert engine.pool.num_free == engine.num_pages and fault.reserved == []

assert advice["pages"] > usable
assert fixed.stats()["num_preemptions"] == 0 and sized["usage"].max() < 0.95
assert [o.text for o in fixed_outs] == [o.text for o in pressured]
assert not wb_fixed.findings_at_least("warn"), wb_fixed.findings
wb.detach()
wb_fixed.detach()
