# %% [markdown]
# # cu_seqlens corrupt: attention over the wrong span, and no error
#
# **What production saw** (field note 4): *"cu_seqlens wrong: must start at 0, be non-decreasing
# (strictly, with no empty sequences), end at the total token count, be int32 and contiguous on
# the device. Otherwise attention silently covers the wrong span. FlashAttention checks only dtype
# and device; FlashInfer skips the checks to avoid a device sync."*
#
# Here: corrupt one packed batch's `cu_seqlens`, watch two answers go wrong with nothing raised,
# let the `cu_seqlens` probe name the rule, the batch index and the request, and run clean again.

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
# ## 1. Reproduce: two entries swapped after packing
# A packed batch puts every sequence's query tokens in one buffer; `cu_seqlens_q[i]..[i+1]` says
# which tokens are sequence *i*'s. `faults.inject(engine, "cu_seqlens_corrupt", mode="swap",
# index=1)` swaps entries 1 and 2 of one decode batch, in the device tensor and in the host copy
# the attention backend plans from: rows 1 and 2 trade queries, each attending over the other's
# pages for one step.

# %%
wb = Workbench(engine).attach("cu_seqlens")
with faults.inject(engine, "cu_seqlens_corrupt", mode="swap", index=1) as fault:
    garbled = engine.generate(prompts, params)
print("corrupted:", fault.corrupted, "\n")
show_answers(questions, garbled, quote=True)

# %% [markdown]
# ## 2. What the probe found
# On every `BatchPacked` event the probe runs the rules a varlen kernel assumes (int32, contiguous,
# on the query's device, B+1 entries, starts at 0, increasing, ends at the token total, each span
# equal to the scheduled length, `max_seqlen` the longest span) and names the first bad segment:
# its batch index and request.

# %%
caught = wb.all_findings()        # Finding objects (kept: wb.reset() below clears the probes)
found = wb.findings
found[["severity", "kind", "step", "request_id", "message"]]

# %%
wb.probe("cu_seqlens").frame()

# %% [markdown]
# **The view.** The span of the packed buffer each sequence's attention covered at that step, as
# scheduled (from the query lengths) and as the corrupted `cu_seqlens_q` told the kernel. A span
# that runs backwards or covers a neighbour's token is attention over the wrong tokens.

# %%
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

# %% [markdown]
# The probe names batch index 0 first: the corrupted tensor gives sequence 0 two tokens. The torch
# reference plans decode rows by their start offsets, so here only rows 1 and 2 changed; a fused
# varlen kernel would also have run sequence 0's attention over its neighbour's query.
#
# The probe's rules are plain functions: run them on any tensor, e.g. the one above, or on
# torch_npu's `actual_seq_lengths` (`check_actual_seq_lengths`, cumulative ends without the 0).

# %%
import torch
from probes.cu_seqlens import check_cu_seqlens

check_cu_seqlens(torch.tensor(told, dtype=torch.int32), int(lengths.sum()), lengths=lengths.tolist())

# %% [markdown]
# ## 3. Root cause
# `cu_seqlens` was edited after packing, and the kernel trusted it: nothing checks that it is
# monotone or matches the lengths that were packed, so the attention of rows 1 and 2 ran over the
# wrong tokens and wrote the result into the other sequence's output rows. One step of that is
# enough: the wrong token is sampled and fed back, and the answer drifts from there. In production
# the same comes from a buffer refilled late or from a stale, reused tensor.

# %%
show_fault("cu_seqlens_corrupt")

# %% [markdown]
# ## 4. The fix: build cu_seqlens once per step and never touch it
# The batch builder computes it as a cumulative sum of the query lengths into a preallocated int32
# buffer; with the fault's edit gone (the with-block's end), the same prompts answer normally and
# the probe, still attached, stays quiet.

# %%
wb.reset()
fixed = engine.generate(prompts, params)
answers(questions, {"cu_seqlens swapped": garbled, "cu_seqlens as packed": fixed})

# %%
wb.findings_at_least("warn")

# %% [markdown]
# ## 5. Checks: the diagnosis still works

# %%
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
