# %% [markdown]
# # buffer_leak: memory grows every step until the process is killed
#
# **What production saw** (field note 7): *"a new cu_seqlens tensor every step, never released by the runtime's
# lazier GC: OOM after ~24 h. Fix: one preallocated buffer, filled in place: flat memory for 72 h."* Public:
# sglang #5375, *~500 MB per node in 3 h*. And: *watch RssAnon + VmSwap, not RSS alone*.
#
# Outputs stay correct the whole time; the only symptom is memory, and only over hours. The leak probe finds it in
# a few dozen steps by naming the per-step tensors that stay alive.

# %%
import ctypes
import gc

import pandas as pd
import plotly.express as px

from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import chat, show_answers, show_fault

pd.set_option("display.max_colwidth", 160)

# %%
show_fault("buffer_leak")

# %% [markdown]
# ## 1. The engine and a healthy baseline
# SmolLM2-135M-Instruct with a large step token budget (`max_num_batched_tokens=32768`), so each step's metadata
# workspace is ~0.9 MB, as a runtime sized for long prompts allocates it: the leak shows in seconds rather than
# hours.
#
# `num_threads=1`: one torch thread. On a small shared machine two OpenMP threads spin against each other and every step gets many times slower; SmolLM2-135M loses little without the second.
#
# The leak probe samples memory every step here (`every=1`; production default: every 16th) and wants 16 samples
# of steady growth.

# %%
engine = Engine.from_default(EngineConfig(num_pages=256, num_threads=1, max_num_batched_tokens=32768))
questions = ["What is the capital of France?", "Write a short poem about the sea.",
             "Name three primary colours.", "Explain in two sentences why the sky is blue."]
prompts = chat(questions)
params = SamplingParams(max_tokens=28, temperature=0.0)
engine.generate(prompts, SamplingParams(max_tokens=4))        # loads the tokenizer, warms up the shapes

LEAK = dict(every=1, window=16, min_growth_bytes=4 << 20, retain_window=16, census_every=8, min_tensor_growth=32)
wb = Workbench(engine, log=False).attach("leak", leak=LEAK)     # no event log: it would grow too
clean_outs = engine.generate(prompts, params)
show_answers(questions, clean_outs)
clean = wb.probe("leak").frame()
clean_findings = wb.findings_at_least("warn")
print("retained per-step tensors:", clean["retained_tensors"].max())
wb.findings

# %% [markdown]
# ## 2. The symptom: the same requests with the leak on
# `faults.inject(engine, "buffer_leak")` wraps the batch builder so every step's index tensors (`cu_seqlens_q/k`,
# `slot_mapping`, positions, block tables, ...) are fresh allocations at the workspace's full size, appended to the
# runtime's pending-free list that never drains. First we hand freed heap back to the OS, so RssAnon measures new
# memory rather than old chunks the leak would quietly reuse.

# %%
wb.reset()
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
with faults.inject(engine, "buffer_leak") as fault:
    leak_outs = engine.generate(prompts, params)        # runs to completion inside the with-block
    leaked = fault.retained_bytes
leaky = wb.probe("leak").frame()
grown = leaky["host_bytes"].iloc[-1] - leaky["host_bytes"].iloc[0]
steps = leaky["step"].iloc[-1] - leaky["step"].iloc[0]
print(f"answers unchanged: {[o.text for o in leak_outs] == [o.text for o in clean_outs]}")
print(f"{steps} steps: {leaked / 2**20:.1f} MiB kept by the runtime, RssAnon + VmSwap up {grown / 2**20:.1f} MiB")

# %% [markdown]
# ## 3. The findings
# The probe keeps a weak reference to every per-step batch tensor that is *not* a view of the builder's
# preallocated buffers; one still alive from every step of its window is an error that names the fields and who
# holds them. The RssAnon + VmSwap series confirms the growth, with the rate extrapolated to a day.

# %%
wb.findings[["probe", "severity", "kind", "step", "message"]]

# %%
caught = {f.kind: f for f in wb.findings_at_least("error")}
for f in caught.values():
    print(f"[{f.severity}] {f.kind}: {f.message}\n  hint: {f.hint}\n")


# %% [markdown]
# ## 4. The view: memory per step
# The process's anonymous memory (RssAnon + VmSwap, relative to the first sample) and the bytes of retained
# per-step tensors, step by step (`wb.probe("leak").frame()`).

# %%
def memory_view(frames):
    rows = []
    for phase, df in frames.items():
        growth = (df["host_bytes"] - df["host_bytes"].iloc[0]) / 2**20
        rows.append(pd.DataFrame({"step": df["step"], "phase": phase, "RssAnon + VmSwap growth (MiB)": growth,
                                  "retained per-step tensors (MiB)": df["retained_bytes"] / 2**20}))
    long = pd.concat(rows).melt(id_vars=["step", "phase"], var_name="series", value_name="MiB")
    return px.line(long, x="step", y="MiB", color="series", line_dash="phase", markers=True,
                   title="memory per step")


memory_view({"leak on": leaky})

# %% [markdown]
# ## 5. Root cause
# The batch builder is meant to fill one preallocated buffer per index tensor in place every step. The faulty path
# allocates a new tensor per step instead; in eager PyTorch that is only churn, but a runtime with a lazier
# allocator/GC (the field note's, sglang's) keeps each one alive, so memory climbs by the workspace size every step:
# at a few steps per second that is gigabytes a day, and the process is killed after about a day. RSS alone can
# hide it (file pages come and go); RssAnon + VmSwap does not.
#
# ## 6. The fix: one buffer per index tensor, filled in place
# That is the engine's own `BatchBuilder` (its `_Buffer`s): leaving the with-block restores it. Every index tensor
# of a batch is then a view of the same storage, step after step:

# %%
wb.reset()
fixed_outs = engine.generate(prompts, params)
fixed = wb.probe("leak").frame()
b = engine.last_batch
same = {name: getattr(b, name).untyped_storage().data_ptr() == buf.host.untyped_storage().data_ptr()
        for name, buf in (("cu_seqlens_q", engine.builder.cu_q), ("cu_seqlens_k", engine.builder.cu_k),
                          ("slot_mapping", engine.builder.slot_mapping), ("positions", engine.builder.positions))}
print("batch tensors are views of the builder's buffers:", same)
print("retained per-step tensors:", fixed["retained_tensors"].max())
memory_view({"leak on": leaky, "fixed": fixed})

# %%
wb.findings

# %% [markdown]
# ## 7. Checks
# The leak is caught and named (the retained `cu_seqlens_q` and friends, held by the fault's pending-free list),
# memory really grew, answers never changed, and the fixed builder leaves the probe silent.

# %%
assert not clean_findings, clean_findings
assert clean["retained_tensors"].max() == 0
ret = caught["retained-step-tensors"]
assert ret.probe == "leak" and ret.severity == "error"
assert "cu_seqlens_q" in ret.message and "BufferLeak.retained" in ret.message
assert "preallocated buffer" in ret.hint
assert leaky["retained_bytes"].iloc[-1] > 0.7 * leaked > 0
assert grown > 0.5 * leaked                                   # RssAnon + VmSwap really rose
assert [o.text for o in leak_outs] == [o.text for o in clean_outs]

assert "build" not in vars(engine.builder) and fault.retained == []
assert all(same.values()) and fixed["retained_tensors"].max() == 0
assert [o.text for o in fixed_outs] == [o.text for o in clean_outs]
assert not wb.findings_at_least("warn"), wb.findings
wb.detach()
