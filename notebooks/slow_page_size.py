# %% [markdown]
# # slow_page_size: throughput halves after an upgrade, outputs unchanged
#
# **What production saw** (field note 8): *"after a runtime upgrade, throughput 79 -> 42 tokens/s: the new kernel
# path requires page_size a power of two >= 16; page_size 12 silently fell back to a slow path. Fix: validate at
# start-up."* Nothing failed and every answer was right; only the dashboards moved.
#
# Here the fault re-pages an idle engine to `page_size=12` with the same KV memory, the way
# `EngineConfig(page_size=12, allow_unsupported_page_size=True)` would build it: no paged kernel takes that size, so
# attention runs the generic fallback. The bandwidth probe's config check names it.

# %%
import time

import pandas as pd
import plotly.express as px

from workbench import ConfigError, Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import PARAGRAPH, chat, show_answers, show_fault

pd.set_option("display.max_colwidth", 160)

# %%
show_fault("slow_page_size")

# %% [markdown]
# ## 1. The engine and a healthy baseline
# SmolLM2-135M-Instruct with 16-token pages.
#
# `num_threads=1`: one torch thread. On a small shared machine two OpenMP threads spin against each other and every step gets many times slower; SmolLM2-135M loses little without the second.
#
# Three short questions and one long one (a pasted
# text of about 500 tokens to summarise), so attention has real context to read.
#
# Time is measured two ways: wall clock, and this process's CPU time (one torch thread, so CPU time is the work
# done, whatever else the machine is running).

# %%
questions = ["What is the capital of France?", "Name three primary colours.", "What is the largest ocean on Earth?",
             "Summarise in one sentence: " + PARAGRAPH * 10]
prompts = chat(questions)
params = SamplingParams(max_tokens=24, temperature=0.0)

# No prefix cache: every run below does the same work, none reuses the pages of the one before.
engine = Engine.from_default(EngineConfig(num_pages=256, num_threads=1, enable_prefix_caching=False))
engine.generate(prompts, SamplingParams(max_tokens=2))       # loads the tokenizer, warms up these shapes


def timed_generate():
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params)
    return outs, time.perf_counter() - t0, time.process_time() - c0


wb = Workbench(engine, log=False).attach("bandwidth")          # no event log: the probe keeps its own rows
clean_outs, clean_s, clean_cpu = timed_generate()
clean = wb.probe("bandwidth").frame()
clean_findings = wb.findings_at_least("warn")
show_answers(questions, clean_outs, width=70)
print(f"page_size {engine.config.page_size}, attention backend '{engine.attn.name}'")
wb.findings

# %% [markdown]
# ## 2. The symptom: the same requests after the "upgrade"
# The fault swaps in a pool, KV cache, block tables and batch buffers for 12-token pages, and the backend
# `get_backend` picks for that size.

# %%
wb.reset()
with faults.inject(engine, "slow_page_size"):
    slow_config = (engine.config.page_size, engine.num_pages, engine.attn.name)
    slow_outs, slow_s, slow_cpu = timed_generate()           # runs to completion inside the with-block
    gathered = engine.attn.bytes_moved
slow = wb.probe("bandwidth").frame()
slow_findings = wb.all_findings()
print("page_size %d, %d pages (the same KV memory), attention backend '%s'" % slow_config)
print("answers unchanged:", [o.text for o in slow_outs] == [o.text for o in clean_outs])
tokens = sum(len(o.token_ids) for o in clean_outs)
pd.DataFrame([
    {"run": "page_size 16", "wall s": clean_s, "cpu s": clean_cpu, "tokens/s": tokens / clean_s,
     "KV bytes read (MiB)": clean["bytes_kv_read"].sum() / 2**20},
    {"run": "page_size 12", "wall s": slow_s, "cpu s": slow_cpu, "tokens/s": tokens / slow_s,
     "KV bytes read (MiB)": gathered / 2**20},
]).round(2)

# %% [markdown]
# Same answers, slower. The last column: what the paged kernel reads (whole pages of the context) against what the
# fallback gathers (every context token of every row, padded to the longest, plus the slot indices).
#
# ## 3. The finding
# The bandwidth probe checks the configuration at attach and whenever the page size changes, and judges each
# step's achieved bandwidth against what this engine reached before for the same batch shape on this machine
# (`baselines.json`; the measured copy peak is a column, information only).

# %%
wb.findings[["probe", "severity", "kind", "step", "message"]]

# %%
caught = [f for f in slow_findings if f.at_least("error")]
print(caught[0].message)
print("\nhint:", caught[0].hint)

# %% [markdown]
# ## 4. The view: step time, before and after
# Every step of both runs (`wb.probe("bandwidth").frame()`): step for step the fallback is slower, and its decode
# steps reach a smaller share of the memory-bandwidth roof.

# %%
both = pd.concat([clean.assign(run="page_size 16", i=range(len(clean))),
                  slow.assign(run="page_size 12", i=range(len(slow)))])
both["ms"] = both["seconds"] * 1000
px.bar(both, x="i", y="ms", color="run", barmode="group", log_y=True,
       hover_data=["step", "tokens", "gbs", "share_of_peak"],
       labels={"i": "step of the run"}, title="step time (log scale): page_size 16 vs 12")

# %%
px.box(both[both["decode_only"]], x="run", y="share_of_peak", points="all",
       title="decode steps: achieved share of the measured peak bandwidth")

# %% [markdown]
# ## 5. Root cause
# Paged kernels (Ascend PagedAttention, FlashAttention's paged KV) find a token's page and offset with a shift and a
# mask, so they take only power-of-two page sizes (Ascend: multiples of 16, 128 recommended). For 12 the runtime
# silently picks a generic path: no per-step plan, a division and modulo per token per layer, K/V gathered token by
# token for the whole (padded) context, KV heads expanded to the query heads. The output is identical; the work is
# not.
#
# ## 6. The fix: a supported page size, validated at start-up
# Use 16, 32, 64 or 128. `EngineConfig` validates it, so the bad size never reaches a running service:

# %%
try:
    EngineConfig(page_size=12)
except ConfigError as e:
    rejected = str(e)
print(rejected)

# %% [markdown]
# Leaving the with-block put the engine back on its 16-token pool and the paged kernel. The same requests again:

# %%
wb.reset()
fixed_outs, fixed_s, fixed_cpu = timed_generate()
print(f"page_size {engine.config.page_size}, backend '{engine.attn.name}': {tokens / fixed_s:.1f} tokens/s")
print("answers unchanged:", [o.text for o in fixed_outs] == [o.text for o in clean_outs])
wb.findings

# %% [markdown]
# ## 7. Checks
# The page size is caught as an error naming `page_size=12` and the fallback, with the supported sizes as the
# hint; the fallback really does more work (the bytes it counted: a count, not a timing, so the check does not
# depend on how busy the machine is); the fixed engine is back on the paged kernel and the probe is silent.

# %%
assert not clean_findings, clean_findings
assert slow_config[0] == 12 and slow_config[2] == "torch-fallback"
assert caught, "slow_page_size was not caught"
f = caught[0]
assert f.probe == "bandwidth" and f.kind == "page-size"
assert "page_size=12" in f.message and "torch-fallback" in f.message and "16, 32, 64 or 128" in f.hint
assert [o.text for o in slow_outs] == [o.text for o in clean_outs]
assert gathered > 1.5 * clean["bytes_kv_read"].sum()          # counted bytes, not time

assert "page_size=12" in rejected and "16, 32, 64 or 128" in rejected
assert engine.config.page_size == 16 and engine.attn.name != "torch-fallback"
assert [o.text for o in fixed_outs] == [o.text for o in clean_outs]
assert not wb.findings_at_least("warn"), wb.findings
wb.detach()
