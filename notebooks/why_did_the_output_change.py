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

# %%
assert any(r["verdict"] == "corruption" and r["layer"] is not None for r in report.rows)
