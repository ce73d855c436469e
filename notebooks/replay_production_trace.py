# %% [markdown]
# # Replay a production trace: Mooncake conversations
#
# Kimi's Mooncake team published an hour of anonymised production requests (FAST'25): arrival time, prompt and
# output length, and a hash id per 512-token prompt block, so requests that share a conversation prefix carry the
# same leading hash ids. We replay it twice:
#
# 1. **Simulated, whole**: the real scheduler and page pool, a cost model instead of the forward pass. Minutes of
#    production in seconds, every event recorded.
# 2. **Through the real model**: a scaled slice through SmolLM2 with every probe on.
#
# Then we look at fragmentation and prefix sharing, and travel back to the moment of peak pressure.

# %%
from workbench.data import mooncake_excerpt, mooncake_full
from workbench.trace import read_trace
path = mooncake_full() or mooncake_excerpt()     # the excerpt ships with the package
trace = read_trace(path)
print(path.name, len(trace), "requests;", f"{trace.repeated_block_fraction():.1%} of prompt blocks repeat an earlier one")
trace.frame().describe()[["prompt_len", "output_len", "num_hash_blocks"]]

# %% [markdown]
# ## 1. The whole trace, simulated
# 65,536 pages of 16 tokens, up to 256 sequences and 16,384 tokens a step (the limits nano-vllm's benchmark uses).

# %%
from workbench import EngineConfig
from workbench.trace import replay
cfg = EngineConfig(page_size=16, num_pages=65536, max_num_seqs=256, max_num_batched_tokens=16384)
sim = replay(trace, cfg, "simulate")
st = sim.engine.stats()
print(f"{len(sim.requests)} requests in {sim.wall_s:.1f} s wall, {len(sim.steps)} steps, {len(sim.log):,} events; "
      f"{st['num_preemptions']} preemptions; prefix cache served {st['prefix_cache_hits'] / st['prefix_cache_queries']:.1%} of prompt tokens")

# %%
import plotly.graph_objects as go
from plotly.subplots import make_subplots
s = sim.steps
fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=("KV pages", "requests"))
fig.add_scatter(x=s.clock_s, y=s.pages_used, name="used", row=1, col=1)
fig.add_scatter(x=s.clock_s, y=s.pages_cached, name="cached-free (reusable prefixes)", row=1, col=1)
fig.add_scatter(x=s.clock_s, y=s.num_running, name="running", row=2, col=1)
fig.add_scatter(x=s.clock_s, y=s.num_waiting, name="waiting", row=2, col=1)
fig.update_layout(height=520, title="Pool timeline (virtual clock, seconds)")
fig.show()

# %% [markdown]
# ## 2. Prefix sharing and fragmentation
#
# Prefix sharing: the prefix cache should serve what the trace says repeats. Fragmentation: paging wastes only the
# unused slots of each sequence's last page; a contiguous allocator that reserves the maximum length for every
# request (what paging replaced) would have reserved far more for the same live requests.

# %%
import numpy as np
r = sim.requests
print(f"requests with a prefix hit: {(r.num_cached_tokens > 0).mean():.1%}; "
      f"median share of prompt served from cache among them: {(r.num_cached_tokens / r.prompt_len)[r.num_cached_tokens > 0].median():.1%}")
waste = (s.waste_slots / (s.pages_mapped.replace(0, np.nan) * 16)).mean()
max_len = int(trace.frame().eval("prompt_len + output_len").max())
contiguous = s.num_running * max_len                       # every live request reserved at max length
paged = s.pages_used * 16
print(f"internal waste of paging: {waste:.2%} of mapped slots; contiguous max-length reservation would need "
      f"{(contiguous / paged.replace(0, np.nan)).median():.0f}x the KV memory at the median step")

# %% [markdown]
# ## 3. Time travel to the moment of peak pressure
# The pool at any step is rebuilt from the event log (keyframes make scrubbing cheap). Here is the step where the most pages were in use: each cell a page; free, cached-free, owned and shared.

# %%
from workbench.trace import TimeTravel
tt = TimeTravel(sim.log, cfg.num_pages)
peak = int(s.loc[s.pages_used.idxmax(), "step"])
state = tt.state_at(peak)
print("step", peak, state.counts())
grid = state.states.reshape(256, -1)
go.Figure(go.Heatmap(z=grid, colorscale=[[0, "#eeeeee"], [0.33, "#9ecae1"], [0.66, "#3182bd"], [1, "#e6550d"]],
                     zmin=0, zmax=3, colorbar=dict(tickvals=[0, 1, 2, 3], ticktext=["free", "cached", "owned", "shared"])),
          layout=dict(title=f"Page pool at step {peak} (peak pressure)", height=500, width=560)).show()

# %% [markdown]
# ## 4. A scaled slice through the real model, every probe on
# The first 24 requests, lengths scaled by 1/64 so they fit a laptop CPU; SmolLM2 generates for real.

# %%
from workbench import Engine, Workbench
wb = Workbench(Engine.from_default(EngineConfig(num_pages=1024, max_num_seqs=16))).attach()
full = replay(trace[:24], wb, "full", length_scale=1 / 64, max_output_len=6, time_scale=0.1)
print(f"{len(full.requests)} requests, {len(full.steps)} steps, prefix hits in {(full.requests.num_cached_tokens > 0).sum()} requests")
wb.findings

# %%
assert len(sim.requests) + len(sim.rejected) == len(trace)
assert st["prefix_cache_hits"] > 0 and state.counts()["owned"] + state.counts()["shared"] == int(s.pages_used.max())
assert len(full.requests) == 24
assert wb.findings[wb.findings.severity.isin(["warn", "error", "critical"])].empty
wb.detach()
