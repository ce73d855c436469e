# %% [markdown]
# # Why did the output change?
#
# "The output changed" is the most common report after an upgrade, a new device, prefix caching switched on or a
# bigger batch. `workbench.diverge.triage(a, b, prompts)` answers it per request: **identical**, **drift** (numeric:
# every difference small, flips only at near ties) or **corruption** (the model saw the wrong K/V), with the first
# wrong token and, on our engine, the layer and page where it starts.
#
# How: side A runs the prompts greedy; side B runs **teacher-forced on A's tokens through its own serving path**
# (pages, prefix cache, batching), so a paged-KV bug corrupts what it reads as in production. Each side runs again in
# another batch composition: that is the measured **noise floor**. A token is corrupt where both sides were sure and
# disagree, or where the difference is 100 times the pair's typical one.
#
# We use a tiny random Llama written here (its next token depends on what attention reads), our engine on both
# sides, and two questions: does a page-size change alter the output? And what does a stale block table do?

# %%
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from workbench import Engine, EngineConfig, faults
from workbench.diverge import triage

model = Path(tempfile.mkdtemp(prefix="diverge-")) / "tiny-llama"
cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2, initializer_range=0.5)
torch.manual_seed(1234)
LlamaForCausalLM(cfg).eval().save_pretrained(model)
rng = np.random.default_rng(3)
prefix = rng.integers(3, 256, 40).tolist()                    # a shared system prompt: prefix-cache hits
prompts = [prefix + rng.integers(3, 256, int(k)).tolist() for k in rng.integers(3, 30, 8)]

# %% [markdown]
# ## 1. Page size 16 against 64: numeric at most
# A different page size changes the kernels' summation order, nothing the model sees.

# %%
a = Engine.from_pretrained(model, EngineConfig(num_pages=256))
b = Engine.from_pretrained(model, EngineConfig(num_pages=64, page_size=64))
report = triage(a, b, prompts, max_tokens=24)
print(report.summary())
report.frame()

# %% [markdown]
# ## 2. A stale block table: corruption, from the token it starts
# `stale_binding` makes the kernel read a block table from before the last update (field note 1). Triage names the
# first corrupt token of each request and, re-running that request to that token with the shadow probe's dense
# recompute, the layer and the page that went wrong.

# %%
c = Engine.from_pretrained(model, EngineConfig(num_pages=256))
with faults.inject(c, "stale_binding"):
    report = triage(Engine.from_pretrained(model, EngineConfig(num_pages=256)), c, prompts, max_tokens=24)
print(report.summary())
report.frame()[["request", "verdict", "first_token", "layer", "pages"]]

# %%
print(report.rows[1]["evidence"])

# %% [markdown]
# ## 3. The strip: every token of every request
# Colour: how far the two sides' log-probs of A's token are apart (green: the noise floor, red: nats). Red squares:
# corrupt tokens. Hover for the numbers.

# %%
report.strip()

# %% [markdown]
# ## 4. Where it starts: the layer curve
# For the first corrupt request: both sides' hidden states and attention outputs, layer by layer, at its first bad
# token (our engine through a model tap, in the same batch composition), against the same at the token before (a
# token both got right: each layer's own floor). The first layer that leaves its floor is where the corruption
# enters. Here the prompts share a 40-token prefix, so a stale page can hold the very K/V layer 0 expected (the same
# tokens at the same positions): the curve leaves the floor where the stale page's K/V really differ.

# %%
bad = next(r["request"] for r in report.rows if r["request"] in report.curves)
report.layer_curve(bad)

# %% [markdown]
# ## 5. The page map: which positions, in which page
# The shadow probe, re-run to that token, recomputes the request densely from its own tokens and compares layer by
# layer; its finding names the first position (and, for a bad read, every query row from there on), mapped onto the
# request's page table.

# %%
print(report.faults[bad]["message"])
report.page_map(bad)

# %% [markdown]
# ## 6. Production's own record: a flight recording as side A
# The engine that served production kept a flight recording (`EngineConfig.record_dir`): the prompts and the tokens
# it produced. Triage takes the recording itself as the reference and a clean engine, teacher-forced on the recorded
# tokens, as the judge: a recorded token the clean engine rejects by more than twice the near-tie bound is
# corruption. Here production ran with the stale block table; nobody kept its log-probs.

# %%
rec_dir = Path(tempfile.mkdtemp(prefix="diverge-rec-")) / "prod"
prod = Engine.from_pretrained(model, EngineConfig(num_pages=256, record_dir=str(rec_dir)))
from workbench import SamplingParams
with faults.inject(prod, "stale_binding"):
    prod.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
prod.recorder.close()
from_recording = triage(str(rec_dir), Engine.from_pretrained(model, EngineConfig(num_pages=256)))
print(from_recording.summary())
from_recording.frame()[["request", "verdict", "first_token", "evidence"]]

# %%
assert any(r["verdict"] == "corruption" and r["layer"] is not None for r in report.rows)
assert report.curves[bad]["layer"] is not None and report.faults[bad]["pages"]
assert any(r["verdict"] == "corruption" for r in from_recording.rows)
