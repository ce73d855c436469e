# %% [markdown]
# # lock_storm: throughput collapses while the other streams update their page tables
#
# **What production saw** (field note 6, Ascend deployment): *"batch 16, the first 10 requests fine, the last 6
# stuck forever 'waiting'; page-table updates went through one global lock shared by all streams. Fix: a stream and
# a context (lock domain) per batch slice: hangs gone, throughput +12%."* The public twin is vllm #45387 (scheduler
# stalls, Running=0 Waiting=N).
#
# Here the engine serves six chat prompts while 16 other streams rewrite their own page tables under the lock the
# engine gives them and call the engine's real `abort()`, and two metrics readers scrape the engine's real
# `engine.stats()`. Nothing touches the requests being served: the only symptom is time.

# %%
import time

import pandas as pd
import plotly.express as px

from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import chat, show_answers, show_fault

pd.set_option("display.max_colwidth", 160)

# %%
show_fault("lock_storm")

# %% [markdown]
# ## 1. The engine and a healthy baseline
# The default model, SmolLM2-135M-Instruct, with the default `page_table_lock="global"`.
#
# `num_threads=1`: one torch thread. On a small shared machine two OpenMP threads spin against each other and every step gets many times slower; SmolLM2-135M loses little without the second.

# %%
engine = Engine.from_default(EngineConfig(num_pages=256, num_threads=1))
engine.generate(["Hello"], SamplingParams(max_tokens=1))      # loads the tokenizer, warms up

questions = ["What is the capital of France?", "Name three primary colours.",
             "Write one sentence about the sea.", "What is the largest ocean on Earth?",
             "What colour is the sky on a clear day?", "Give me a synonym for happy."]
prompts = chat(questions)

params = SamplingParams(max_tokens=16, temperature=0.0)


def timed_generate(eng):
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    return outs, time.perf_counter() - t0


# %% [markdown]
# The lock probe (`lock_contention`) measures every wait for and hold of every instrumented lock, and how much of
# each step the engine thread spent waiting. A healthy run waits for nothing.

# %%
wb_clean = Workbench(engine, log=False).attach("lock_contention")   # no event log: the probe keeps its own rows
clean_outs, clean_s = timed_generate(engine)
clean_share = wb_clean.probe("lock_contention").wait_share()
show_answers(questions, clean_outs)
print(f"{clean_s:.1f} s; the engine waited for 'page_table' {clean_share:.0%} of the step time")
clean_findings = wb_clean.findings
# The storm is sized from this machine's own step time: each stream holds the lock a quarter of a step, so the share
# of the step spent waiting is about the same on a fast or a slow CPU (a fixed hold would be a large share of a
# fast step and a small one of a slow step).
step_s = wb_clean.probe("lock_contention").steps_frame()["duration_ms"].median() / 1e3
hold_s = max(0.002, step_s / 4)
print(f"median step {step_s * 1e3:.1f} ms: each stream holds the lock {hold_s * 1e3:.1f} ms per table update")
wb_clean.detach()
clean_findings

# %% [markdown]
# ## 2. The symptom: the same requests with the lock storm on
# `faults.inject(engine, "lock_storm", submitters=16, hold_s=hold_s)` starts 16 stream threads (batch 16, as in the
# field note) that each update their page table under `engine.table_lock(stream)` and keep the lock across the
# host-to-device copy (`hold_s`, a quarter of a step here), then call `engine.abort()` with the stream's own id (a negative id the engine never issues, so nothing is
# aborted: it is the engine's real abort path, lock and all), plus two `stats()` scrapers. With the global lock,
# `abort()` and `stats()` take the step's lock themselves, so all of them queue on the lock the engine's step needs.

# %%
wb = Workbench(engine, log=False).attach("lock_contention")
with faults.inject(engine, "lock_storm", submitters=16, hold_s=hold_s) as storm:
    storm_outs, storm_s = timed_generate(engine)       # runs to completion inside the with-block
probe = wb.probe("lock_contention")
storm_share = probe.wait_share()
print(f"{storm.updates} page-table updates and {storm.aborts} abort() calls by the stream threads, "
      f"{storm.scrapes} stats() scrapes")
tokens = sum(len(o.token_ids) for o in clean_outs)
pd.DataFrame([
    {"run": "global lock, quiet", "seconds": clean_s, "tokens/s": tokens / clean_s, "engine wait share": clean_share},
    {"run": "global lock, lock storm", "seconds": storm_s, "tokens/s": tokens / storm_s,
     "engine wait share": storm_share},
]).round(2)

# %% [markdown]
# Same answers, word for word (the storm never touches these requests), but far fewer tokens per second.

# %%
print("answers unchanged:", [o.text for o in storm_outs] == [o.text for o in clean_outs])

# %% [markdown]
# ## 3. The finding
# The probe compares, every 8 steps, the time the engine thread spent waiting for each lock with the step time, and
# names the call sites that held that lock the longest.

# %%
wb.findings[["probe", "severity", "kind", "lock", "step", "message"]]

# %%
caught = wb.findings_at_least("error")
print(caught[0].message)
print("\nhint:", caught[0].hint)

# %% [markdown]
# ## 4. The view: who holds the lock, and what it costs each step
# Left: hold time per call site (`probe.frame()`): the stream threads' table update in `lock_storm.py` dwarfs the
# engine's own critical sections in `engine.py`; the streams' `engine.py abort` and the scrapers' `engine.py stats`
# hold it briefly but wait for it as long as the step does. Right: each step's time split into waiting for
# `page_table` and working (`probe.steps_frame()`).

# %%
cols = ["lock", "site", "count", "contended", "wait_p50_ms", "wait_p99_ms", "hold_p50_ms", "hold_total_ms"]
probe.frame()[cols].round(2)

# %%
probe.widget()

# %%
steps = probe.steps_frame()
steps["working_ms"] = steps["duration_ms"] - steps["wait_page_table_ms"]
px.bar(steps, x="step", y=["wait_page_table_ms", "working_ms"],
       labels={"value": "ms", "variable": ""}, title="lock storm: each step's time, waiting vs working")

# %% [markdown]
# ## 5. Root cause
# One lock guards unrelated things: the engine's step (scheduling, page allocation, binding), every stream's
# submission (`add_request`), abort and page-table update, and every metrics read (`stats()`). Each stream holds it
# across a host-to-device copy, so the step queues behind up to 16 copies several times per step. Requests are not
# wrong, just late: the ones admitted last sit "waiting" while the lock changes hands. Nothing here is a bug in any
# one thread; the lock's *domain* is too wide.
#
# ## 6. The fix: a lock domain per stream
# `EngineConfig(page_table_lock="sharded")` gives each stream shard its own lock (`engine.table_lock(stream)`
# returns the shard); `add_request` and `abort` register under their request's shard only, and `stats()` returns a
# snapshot the engine publishes (at construction, after each step and each abort), so neither a submission, an
# abort, a table update nor a metrics read ever waits on (or stalls) the step's lock. Same model, same storm:

# %%
fixed = Engine.from_default(EngineConfig(num_pages=256, num_threads=1, page_table_lock="sharded"))
fixed.tokenizer = engine.tokenizer         # the same model file: reuse the tokenizer already loaded
fixed.generate(["Hello"], SamplingParams(max_tokens=1))

wb_fixed = Workbench(fixed, log=False).attach("lock_contention")
with faults.inject(fixed, "lock_storm", submitters=16, hold_s=hold_s) as storm_fixed:
    fixed_outs, fixed_s = timed_generate(fixed)
fixed_probe = wb_fixed.probe("lock_contention")
print(f"{storm_fixed.updates} page-table updates and {storm_fixed.aborts} abort() calls by the stream threads, "
      f"{storm_fixed.scrapes} stats() scrapes")
pd.DataFrame([
    {"run": "global lock, lock storm", "seconds": storm_s, "tokens/s": tokens / storm_s,
     "engine wait share": storm_share},
    {"run": "sharded locks, lock storm", "seconds": fixed_s, "tokens/s": tokens / fixed_s,
     "engine wait share": fixed_probe.wait_share()},
]).round(2)

# %% [markdown]
# The storm still runs, on the shard locks (`page_table[i]` rows below: the streams' table updates and their
# `abort()` calls, and this notebook's own `add_request` calls from `generate()`), and the engine's step no longer
# waits: only the step itself takes `page_table` now.

# %%
fixed_probe.frame()[["lock", "site", "count", "contended", "hold_total_ms"]].round(1)

# %%
wb_fixed.findings


# %% [markdown]
# ## 7. What moved off the step's lock: the engine's own paths
# The fix is not a property of the fault: `add_request`, `abort` and `stats()` are the engine's public paths, and
# the fault's threads call them. `submit=True` makes every stream also submit a one-token request with the real
# `add_request` and abort it at once, so all three calls are timed from the fault's threads (`storm.calls`,
# `storm.latency_frame()`). Those tiny requests are real: when the engine drains one before its abort it joins a
# step's batch, so these runs' answers are not compared with anything.

# %%
def real_paths(eng):
    # The storm with submit=True: the step's lock wait share, call latencies from the fault's threads, lock rows.
    wb_m = Workbench(eng, log=False).attach("lock_contention")
    with faults.inject(eng, "lock_storm", submitters=16, submit=True, hold_s=hold_s) as st:
        timed_generate(eng)
    pr = wb_m.probe("lock_contention")
    share, frame = pr.wait_share(), pr.frame()
    wb_m.detach()
    while eng.has_unfinished():              # a submitted-and-aborted pair may still be queued: finish it
        eng.step()
    return share, st.latency_frame(), frame


g_share, g_lat, g_frame = real_paths(engine)
s_share, s_lat, s_frame = real_paths(fixed)
paths = pd.concat([g_lat.assign(page_table_lock="global"), s_lat.assign(page_table_lock="sharded")])
wide = paths.pivot(index="page_table_lock", columns="call", values=["p50_ms", "p99_ms"])
wide.columns = [f"{call} {q}" for q, call in wide.columns]
wide.insert(0, "step's lock wait share", pd.Series({"global": g_share, "sharded": s_share}))
wide.round(3)

# %% [markdown]
# With the global lock, all three calls and the step queue on one lock: the p99s are tens of milliseconds, and the
# step spends most of its time waiting. (The global medians are low because a stream re-takes the lock it has just
# released, and Python's locks are not fair; the p99 is what everyone else sees.) Sharded, the step's wait share is
# zero and `stats()` takes microseconds. `add_request` and `abort` still wait sometimes, but for a *shard*: 16 streams
# share 8 shards and each holds its shard across a copy (a quarter of a step) most of the time, so a request landing on a busy shard
# waits for another stream's copy. That is stream against stream inside one lock domain, never the step; more
# domains (one per stream, as in the field note) would remove it. Where each call went:

# %%
fig = px.bar(paths, x="call", y="p99_ms", color="page_table_lock", barmode="group", log_y=True,
             labels={"p99_ms": "p99 latency (ms, log)"},
             title="the engine's real paths, called by the storm's threads: p99 latency")
fig

# %%
real_sites = ["engine.py add_request", "engine.py abort", "engine.py stats"]
where = pd.concat([g_frame.assign(page_table_lock="global"), s_frame.assign(page_table_lock="sharded")])
where = where[where.site.isin(real_sites)]
where.assign(lock=where.lock.str.replace(r"\[\d+\]", "[shard]", regex=True)).groupby(
    ["page_table_lock", "site", "lock"])[["count", "contended", "wait_p99_ms"]].agg(
    {"count": "sum", "contended": "sum", "wait_p99_ms": "max"}).round(2)

# %% [markdown]
# What moved off the step's lock: `stats()` now takes no lock at all (a snapshot read), `add_request` and `abort`
# take only their request's shard (`page_table[shard]` rows), and `page_table` is taken by the engine thread alone
# (the step's sections and applying an abort), so nobody can make the step wait.
#
# ## 8. Checks
# The fault is caught (an error on lock `page_table` naming the storm's call site, with the sharding hint); the
# answers are unchanged; with sharded locks the same storm leaves the probe silent; the engine's own
# `add_request` / `abort` / `stats()` queue on the step's lock with the global lock and never touch it sharded.

# %%
assert not clean_findings["severity"].isin(["warn", "error", "critical"]).any(), clean_findings
assert storm.updates > 0 and storm.scrapes > 0
assert caught, "lock_storm was not caught"
f = caught[0]
assert f.probe == "lock_contention" and f.lock == "page_table" and "page_table" in f.message
assert "lock_storm.py" in f.message                      # the call site that held the lock
assert "page_table_lock='sharded'" in f.hint
assert [o.text for o in storm_outs] == [o.text for o in clean_outs]

assert storm_fixed.updates > 0 and storm_fixed.scrapes > 0
assert fixed_probe.frame().lock.str.startswith("page_table[").any()   # the storm went to the shards
assert not wb_fixed.findings_at_least("warn"), wb_fixed.findings
assert [o.text for o in fixed_outs] == [o.text for o in clean_outs]

for name in real_sites:                                  # global: each real path queued on the step's lock
    rows = g_frame[(g_frame.lock == "page_table") & (g_frame.site == name)]
    assert len(rows) == 1 and rows.contended.iloc[0] > 0, name
on_table = s_frame[s_frame.lock == "page_table"]           # sharded: only the engine thread takes it
assert not on_table.site.isin(real_sites).any() and on_table.contended.sum() == 0
assert not s_frame[s_frame.site == "engine.py stats"].shape[0]          # a snapshot read, no lock
assert set(s_lat.call) == set(g_lat.call) == {"add_request", "abort", "stats"}
assert g_share > 0.30 and s_share < 0.05
wb.detach()
wb_fixed.detach()
