# %% [markdown]
# # FP16 KV overflow: `<unk>` and garbage from a larger model
#
# **What production saw** (field note 5): *"FP16 overflow: a larger model (Qwen-7B) produced
# `<unk>` and garbage while a small one was fine and training loss looked perfect: some layers'
# K/V exceed 65504 and become inf. Fix reported: a scale per page (absmax-based, stored with the
# page, applied on write, undone on read): accuracy 63% -> 99.2%."* Public: vllm #14126 (Qwen,
# "!!!!!!" in fp16), vllm #40290, vllm-ascend #6332.
#
# Here: the default model with a float16 KV cache answers fine; give one layer the large K/V of
# the bigger model and it answers nothing; the `fp16_overflow` probe names the layer, page and
# request; the per-page scaled cache (`kv_cache_dtype="fp16_scaled"`) answers right again.

# %%
import pandas as pd
import plotly.express as px
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import QUESTIONS, answers, chat, show_answers, show_fault

pd.set_option("display.max_colwidth", None)
questions = QUESTIONS[:2]                                   # France's capital, three colours
prompts = chat(questions)
params = SamplingParams(max_tokens=16, temperature=0.0)

engine = Engine.from_default(EngineConfig(num_pages=64, kv_cache_dtype="float16"))
wb = Workbench(engine).attach("fp16_overflow")          # measures every 4th step
healthy = engine.generate(prompts, params)
show_answers(questions, healthy, quote=True)

# %% [markdown]
# The small model's K/V sit far below 65504, so the float16 cache holds them: the answers are
# right and the probe is silent.
#
# ## 1. Reproduce: one layer with a larger model's K/V
# `faults.inject(engine, "fp16_kv_overflow")` scales the middle layer's (15 of 30) `k_proj` and
# `v_proj` up by a power of two and its `q_proj` / `o_proj` down by the same factor: in float32
# the model computes exactly the same function, but that layer's K/V now exceed fp16's range, as
# in the bigger model. Only the cast into the float16 KV cache breaks.

# %%
with faults.inject(engine, "fp16_kv_overflow") as fault:
    broken = engine.generate(prompts, params)
print(f"layer {fault.layer}: K/V x {fault.factor:g}\n")
for q, o in zip(questions, broken):
    shown = engine.tokenizer.decode(o.token_ids, skip_special_tokens=False)
    print(f"Q: {q}\nA: {o.text!r}   tokens {o.token_ids} = {shown!r}\n")

# %% [markdown]
# The answers are empty: every token is id 0, `<|endoftext|>` (this vocabulary's `<unk>`): the
# cache stored inf, attention over inf returned NaN, NaN logits, argmax 0.
#
# ## 2. What the probe found
# Before each KV write, the probe measures per layer the absmax of K, V and the hidden state against
# 65504, and any inf/NaN, and names the first layer of the step with a problem, the page and the
# request of the first offending token. In a plain float16 cache, K/V over 65504 is an error.

# %%
found = wb.findings
found[["severity", "kind", "step", "layer", "request_id", "page", "message"]]

# %%
over = next(f for f in wb.findings_at_least("error") if f.kind == "fp16-kv-overflow")
print(over.message, "\nhint:", over.hint)

# %% [markdown]
# **The view.** The probe's frame: K/V absmax per layer over fp16's limit (1.0 = 65504), on the
# first measured step under the fault. One layer is about twenty times past the limit; the rest are far
# below it. `wb.probe("fp16_overflow").widget()` draws the same per layer and step as a heatmap.

# %%
df = wb.probe("fp16_overflow").frame()
at = df[df.step == over.step]
fig = px.bar(at, x="layer", y="kv_headroom", log_y=True, height=320,
             labels={"kv_headroom": "K/V absmax / 65504"},
             title=f"step {over.step}: K/V headroom per layer (float16 KV cache)")
fig.add_hline(y=1.0, line_dash="dash", annotation_text="fp16 max 65504")
fig

# %% [markdown]
# ## 3. Root cause
# float16 tops out at 65504. Large models have layers whose keys and values are large (outlier
# channels); training in bf16 or fp32 never notices, so the loss looks perfect. Cast into a float16
# KV cache they become inf; the scores over them are inf or NaN, the softmax is NaN, and from that
# layer on every hidden state is NaN. A small model is fine only because its K/V happen to be small.

# %%
show_fault("fp16_kv_overflow")

# %% [markdown]
# ## 4. The fix: a scale per page
# `kv_cache_dtype="fp16_scaled"` keeps float16 pages (the same memory) with a scale per page: on
# write, values are divided by the page's absmax-based scale; on read, multiplied back. Same model,
# same fault, new engine:

# %%
fixed_engine = Engine.from_default(EngineConfig(num_pages=64, kv_cache_dtype="fp16_scaled"))
wb_fixed = Workbench(fixed_engine).attach("fp16_overflow")
with faults.inject(fixed_engine, "fp16_kv_overflow") as fixed_fault:
    fixed = fixed_engine.generate(prompts, params)
answers(questions, {"float16 KV, before": healthy, "float16 KV, large K/V": broken,
                    "fp16_scaled KV, large K/V": fixed})

# %%
wb_fixed.findings[["severity", "kind", "layer", "message"]]     # info only: the scales absorbed it

# %% [markdown]
# ## 5. Checks: the diagnosis still works

# %%
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
