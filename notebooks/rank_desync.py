# %% [markdown]
# # Rank desync: two cards, one answers garbage
#
# **What production saw** (field note 9, two-card tensor parallel on Ascend): *"two cards, card 0
# correct, card 1 random characters; each card kept its own host copy of the page table and they
# diverged. Fix: one source of truth for the table, shared or broadcast; compare digests per step."*
#
# Here: our engine runs tensor parallel over torch.distributed (gloo, two real processes on this
# machine), the `rank_desync` fault puts rank 1 back on its own host copy of the page table and
# loses some of the driver's updates, the `rank_consistency` probe names the rank, request and
# pages at the first drifted step, and the fix clears it.

# %%
import pandas as pd
import plotly.express as px
from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import QUESTIONS, answers, chat, show_answers, show_fault

pd.set_option("display.max_colwidth", None)
# Two ranks: this kernel is rank 0 (the driver: it schedules and samples), one spawned worker is rank 1.
engine = Engine.from_default(EngineConfig(num_pages=128, tensor_parallel_size=2))
print("split:", engine.parallel.plan.describe())
print("worker pids:", engine.parallel.worker_pids())
questions = QUESTIONS
prompts = chat(questions)
params = SamplingParams(max_tokens=24, temperature=0.0)

# %% [markdown]
# ## 1. The healthy engine: one source of truth
# SmolLM2-135M has 9 query heads over 3 KV heads. Heads go to ranks in whole GQA groups: rank 0
# holds KV heads 0-1 (query heads 0-5), rank 1 KV head 2 (query heads 6-8); the MLP rows are split
# so both stream the same weight bytes. Every rank holds the same page ids (its own heads of
# each page). Each step the driver broadcasts the plan, its block table included; every rank binds
# those bytes after checking their crc. The probe compares every rank's digest after every forward.

# %%
wb = Workbench(engine).attach("rank_consistency")
clean = engine.generate(prompts, params)
show_answers(questions, clean)
print("findings on the clean run:", len(wb.findings))

# %% [markdown]
# ## 2. Reproduce: rank 1 keeps its own copy, and some updates never arrive
# `faults.inject(engine, "rank_desync", rank=1)` switches rank 1 to the production setup: it
# builds its block table from its own host copy of the page lists, kept by the driver's update
# messages, and the updates for the requests in the odd rows of the batch stop reaching it.

# %%
engine.reset_prefix_cache()          # the same prompts are computed again, not served from cache
wb.reset()
with faults.inject(engine, "rank_desync", rank=1) as fault:
    garbled = engine.generate(prompts, params)
print(f"rank 1 lost {len(fault.dropped)} page-table updates, the first at step {min(s for s, *_ in fault.dropped)}\n")
show_answers(questions, garbled, quote=True)

# %% [markdown]
# ## 3. What the probe found
# After every forward each rank computes, with the probe's own function and from its own state,
# a digest: the crc32 of the block-table bytes it bound, their shape and version, the crc32 of its
# slot mapping, its count of free pages and a crc32 of its refcounts (one all-gather of 9 int64 per
# rank). When a rank's digest differs from rank 0's, the probe fetches the rows from every rank and
# names the rank, the request, the row and the pages.

# %%
caught = wb.all_findings()
found = wb.findings
found[["severity", "kind", "step", "request_id", "page", "message"]]

# %% [markdown]
# The first finding in detail: the row rank 1 bound against the row the driver bound.

# %%
first = next(f for f in caught if f.kind == "rank-desync")
ev = first.evidence
print(f"step {first.step}: rank {ev['rank']}, request {first.request_id}, row {ev['row']}; rank {ev['rank']} "
      f"binds from its host copy: {ev['binds_host_copy']}; its page list for the request: {ev['page_list_rank']}")
pd.DataFrame({"rank 1 read": ev["row_rank"], "rank 0 (driver)": ev["row_driver"]},
             index=[f"column {i}" for i in range(len(ev["row_rank"]))]).T

# %% [markdown]
# **The view.** Every rank reports each step (`RankStepFinished`: step time, time in collectives,
# bytes, the crc of the table it bound) to the driver's event log. Rank 1's table digest stops
# agreeing with rank 0's at the first step the fault was on; the dashboard's per-rank strip shows it.

# %%
ranks = wb.log.frame("RankStepFinished")
ref = ranks[ranks["rank"] == 0].set_index("step").table_crc
ranks["table digest"] = ["agrees with rank 0" if ref.get(s) == c else "differs"
                         for s, c in zip(ranks.step, ranks.table_crc)]
ranks["step ms"] = ranks.duration_ns / 1e6
px.scatter(ranks, x="step", y=ranks["rank"].astype(str), color="table digest", size="step ms",
           labels={"y": "rank"}, height=300, title="rank_desync: rank 1's bound table drifts from the driver's")

# %%
from workbench.widgets.rank_strip import RankStrip
RankStrip(wb.log, engine.parallel.world).widget

# %% [markdown]
# ## 4. Root cause
# Tensor parallelism splits the heads, not the pages: every rank must read the same page ids for
# each request. Production kept a host copy of the page table on every card, updated by messages
# from the scheduler. Card 1 missed the updates for some rows: a request admitted there had no
# page list on that card (its row read page 0), one that grew kept its old list. Paged-attention
# kernels do not check whose page they read; rank 1's partial sums of every layer, all-reduced
# into every token's hidden state, garbled the whole answer, not just rank 1's heads.

# %%
show_fault("rank_desync")
pd.DataFrame(fault.dropped, columns=["step", "request", "row", "pages in the lost update"]).head(8)

# %% [markdown]
# ## 5. The fix: one source of truth, broadcast and digest-checked
# Leaving the with-block puts rank 1 back on the driver's table (broadcast with the plan, crc
# checked before the bind), resyncs every rank's host copy and flushes the prefix cache (rank 1
# wrote K/V through the wrong pages). Same prompts, probe still on:

# %%
wb.reset()
fixed = engine.generate(prompts, params)
answers(questions, {"clean": clean, "rank 1 desynced": garbled, "one source of truth": fixed})

# %%
wb.findings_at_least("warn")      # nothing: every rank's digest agrees on every step

# %% [markdown]
# ## 6. Checks: the diagnosis still works, and nothing is left running

# %%
errors = [f for f in caught if f.kind == "rank-desync"]
assert errors, "the rank_consistency probe did not catch the desync"
drift = min(s for s, *_ in fault.dropped)
assert min(f.step for f in errors) == drift, "not caught at the first drifted step"
assert all(f.evidence["rank"] == 1 and f.evidence["pages_rank"] != f.evidence["pages_driver"] for f in errors)
assert {f.request_id for f in errors if f.step == drift} == {r for s, r, *_ in fault.dropped if s == drift}
assert any(g.token_ids != c.token_ids for g, c in zip(garbled, clean)), "the fault changed no answer"
assert [o.token_ids for o in fixed] == [o.token_ids for o in clean] and "Paris" in fixed[0].text
assert wb.findings_at_least("warn") == []
wb.detach()
engine.close()                    # shuts the worker down (also on kernel exit); the driver reaps it
print({pid: p.exitcode for pid, p in zip(engine.parallel.worker_pids(), engine.parallel.procs.values())})
assert all(p.exitcode == 0 for p in engine.parallel.procs.values()), "a worker outlived the engine"
