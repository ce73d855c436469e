# %% [markdown]
# # Size your pool
#
# Field note 10: size the KV pool from production's P99 length, not the training `max_len`:
# `num_pages = ceil(max_batch x P99 length / page_size) x 1.3`. A service with `max_len` 2048 but 99% of requests
# under 512 needs 2,048 pages, not 16,384. The advisor computes the rule for your trace, then checks it (and
# smaller and larger pools, and other page sizes) by simulating the trace through the real scheduler and page pool.

# %%
from pathlib import Path
from workbench.data import mooncake_excerpt
from workbench.trace import read_trace
azure = Path.cwd().resolve().parents[1] / "shared" / "traces" / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"
trace = read_trace(azure if azure.exists() else mooncake_excerpt())
print(trace.source, len(trace), "requests")
lengths = trace.frame().eval("prompt_len + output_len")
lengths.describe(percentiles=[0.5, 0.9, 0.99])

# %% [markdown]
# ## The sweep
# Page sizes 16 to 128, pool sizes around the rule's figure, 64 concurrent sequences, the first 1,500 requests.

# %%
from workbench.trace import advise, recommend
table = advise(trace, page_sizes=(16, 32, 64, 128), limit=1500, max_batch=64, time_scale=0.05)
table

# %%
import plotly.express as px
px.line(table, x="num_pages", y="preemptions", color="page_size", markers=True, log_x=True,
        title="Preemptions (recompute storms) against pool size").show()
px.bar(table.groupby("page_size", as_index=False)[["internal_waste"]].mean(), x="page_size", y="internal_waste",
       title="Internal waste: unused slots in last pages grow with the page size").show()

# %% [markdown]
# ## The recommendation
#
# Smaller pages waste less but need bigger page tables and more page-table lookups (on Ascend, page_size 16 with
# head_dim 128 measured best; keep `page_size x head_dim` constant). The advisor picks the smallest pool with no
# rejection and no preemption over this trace, and shows how the rule of thumb fared.

# %%
rec = recommend(table)
rec

# %%
row = table[(table.page_size == rec["page_size"]) & (table.num_pages == rec["num_pages"])].iloc[0]
assert row.preemptions == 0 and row.rejections == 0
assert table.groupby("page_size").internal_waste.mean().is_monotonic_increasing
small = table[table.num_pages == table.groupby("page_size").num_pages.transform("min")]
assert (small.peak_usage >= table.groupby("page_size").peak_usage.transform("min").loc[small.index]).all()
