"""Write the fault-diagnosis notebooks for lock_storm, lock_inversion, buffer_leak,
slow_page_size and pool_pressure (issue 6), without outputs.

    python scripts/make_notebooks_b.py          # rewrites notebooks/<fault>.ipynb

Each notebook walks from the symptom production saw to the probe's finding, the cause,
the fix, and a clean run, and ends in assertions so tests/test_notebooks.py fails when a
diagnosis stops working. Edit the cells here, not in the .ipynb files.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

OUT = Path(__file__).resolve().parents[1] / "notebooks"


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


# One torch thread: on a shared 2-core machine two OpenMP threads spin against each other
# and every step gets many times slower; the model gains little from the second one.
ENGINE_NOTE = ("`num_threads=1`: one torch thread. On a small shared machine two OpenMP threads spin against "
               "each other and every step gets many times slower; SmolLM2-135M loses little without the second.")

SETUP = """
import time

import pandas as pd
import plotly.express as px

from workbench import ConfigError, Engine, EngineConfig, SamplingParams, Workbench, faults

pd.set_option("display.max_colwidth", 160)
"""

QUESTIONS = """
questions = ["What is the capital of France?", "Name three primary colours.",
             "Write one sentence about the sea.", "What is the largest ocean on Earth?",
             "What colour is the sky on a clear day?", "Give me a synonym for happy."]
prompts = [[{"role": "user", "content": q}] for q in questions]
"""

PARAGRAPH = """
paragraph = ("Paged attention stores the key and value cache of every request in fixed-size pages. "
             "A page table maps each request's token positions to physical pages, so memory is "
             "allocated on demand instead of being reserved for the longest possible request. ")
"""


def catalogue_row(name: str) -> str:
    return f'faults.catalogue().set_index("fault").loc["{name}"]'


# ---------------------------------------------------------------------------------------
def lock_storm():
    return [
        md("""
# lock_storm: throughput collapses while the other streams update their page tables

**What production saw** (field note 6, Ascend deployment): *"batch 16, the first 10 requests fine, the last 6
stuck forever 'waiting'; page-table updates went through one global lock shared by all streams. Fix: a stream and
a context (lock domain) per batch slice: hangs gone, throughput +12%."* The public twin is vllm #45387 (scheduler
stalls, Running=0 Waiting=N).

Here the engine serves six chat prompts while 16 other streams rewrite their own page tables under the lock the
engine gives them and call the engine's real `abort()`, and two metrics readers scrape the engine's real
`engine.stats()`. Nothing touches the requests being served: the only symptom is time.
"""),
        code(SETUP),
        code(catalogue_row("lock_storm")),
        md(f"""
## 1. The engine and a healthy baseline
The default model, SmolLM2-135M-Instruct, with the default `page_table_lock="global"`.

{ENGINE_NOTE}
"""),
        code("""
engine = Engine.from_default(EngineConfig(num_pages=256, num_threads=1))
engine.generate(["Hello"], SamplingParams(max_tokens=1))      # loads the tokenizer, warms up
""" + QUESTIONS + """
params = SamplingParams(max_tokens=16, temperature=0.0)


def timed_generate(eng):
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    return outs, time.perf_counter() - t0
"""),
        md("""
The lock probe (`lock_contention`) measures every wait for and hold of every instrumented lock, and how much of
each step the engine thread spent waiting. A healthy run waits for nothing.
"""),
        code("""
wb_clean = Workbench(engine, log=False).attach("lock_contention")   # no event log: the probe keeps its own rows
clean_outs, clean_s = timed_generate(engine)
clean_share = wb_clean.probe("lock_contention").wait_share()
for q, o in zip(questions, clean_outs):
    print(f"Q: {q}\\nA: {o.text.strip()}\\n")
print(f"{clean_s:.1f} s; the engine waited for 'page_table' {clean_share:.0%} of the step time")
clean_findings = wb_clean.findings
wb_clean.detach()
clean_findings
"""),
        md("""
## 2. The symptom: the same requests with the lock storm on
`faults.inject(engine, "lock_storm", submitters=16)` starts 16 stream threads (batch 16, as in the field note)
that each update their page table under `engine.table_lock(stream)` and keep the lock across the host-to-device
copy, then call `engine.abort()` with the stream's own id (a negative id the engine never issues, so nothing is
aborted: it is the engine's real abort path, lock and all), plus two `stats()` scrapers. With the global lock,
`abort()` and `stats()` take the step's lock themselves, so all of them queue on the lock the engine's step needs.
"""),
        code("""
wb = Workbench(engine, log=False).attach("lock_contention")
with faults.inject(engine, "lock_storm", submitters=16) as storm:
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
"""),
        md("""
Same answers, word for word (the storm never touches these requests), but far fewer tokens per second.
"""),
        code("""
print("answers unchanged:", [o.text for o in storm_outs] == [o.text for o in clean_outs])
"""),
        md("""
## 3. The finding
The probe compares, every 8 steps, the time the engine thread spent waiting for each lock with the step time, and
names the call sites that held that lock the longest.
"""),
        code("""
wb.findings[["probe", "severity", "kind", "lock", "step", "message"]]
"""),
        code("""
caught = wb.findings_at_least("error")
print(caught[0].message)
print("\\nhint:", caught[0].hint)
"""),
        md("""
## 4. The view: who holds the lock, and what it costs each step
Left: hold time per call site (`probe.frame()`): the stream threads' table update in `lock_storm.py` dwarfs the
engine's own critical sections in `engine.py`; the streams' `engine.py abort` and the scrapers' `engine.py stats`
hold it briefly but wait for it as long as the step does. Right: each step's time split into waiting for
`page_table` and working (`probe.steps_frame()`).
"""),
        code("""
cols = ["lock", "site", "count", "contended", "wait_p50_ms", "wait_p99_ms", "hold_p50_ms", "hold_total_ms"]
probe.frame()[cols].round(2)
"""),
        code("""
probe.widget()
"""),
        code("""
steps = probe.steps_frame()
steps["working_ms"] = steps["duration_ms"] - steps["wait_page_table_ms"]
px.bar(steps, x="step", y=["wait_page_table_ms", "working_ms"],
       labels={"value": "ms", "variable": ""}, title="lock storm: each step's time, waiting vs working")
"""),
        md("""
## 5. Root cause
One lock guards unrelated things: the engine's step (scheduling, page allocation, binding), every stream's
submission (`add_request`), abort and page-table update, and every metrics read (`stats()`). Each stream holds it
across a host-to-device copy, so the step queues behind up to 16 copies several times per step. Requests are not
wrong, just late: the ones admitted last sit "waiting" while the lock changes hands. Nothing here is a bug in any
one thread; the lock's *domain* is too wide.

## 6. The fix: a lock domain per stream
`EngineConfig(page_table_lock="sharded")` gives each stream shard its own lock (`engine.table_lock(stream)`
returns the shard); `add_request` and `abort` register under their request's shard only, and `stats()` returns a
snapshot the engine publishes (at construction, after each step and each abort), so neither a submission, an
abort, a table update nor a metrics read ever waits on (or stalls) the step's lock. Same model, same storm:
"""),
        code("""
fixed = Engine.from_default(EngineConfig(num_pages=256, num_threads=1, page_table_lock="sharded"))
fixed.tokenizer = engine.tokenizer         # the same model file: reuse the tokenizer already loaded
fixed.generate(["Hello"], SamplingParams(max_tokens=1))

wb_fixed = Workbench(fixed, log=False).attach("lock_contention")
with faults.inject(fixed, "lock_storm", submitters=16) as storm_fixed:
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
"""),
        md("""
The storm still runs, on the shard locks (`page_table[i]` rows below: the streams' table updates and their
`abort()` calls, and this notebook's own `add_request` calls from `generate()`), and the engine's step no longer
waits: only the step itself takes `page_table` now.
"""),
        code("""
fixed_probe.frame()[["lock", "site", "count", "contended", "hold_total_ms"]].round(1)
"""),
        code("""
wb_fixed.findings
"""),
        md("""
## 7. What moved off the step's lock: the engine's own paths
The fix is not a property of the fault: `add_request`, `abort` and `stats()` are the engine's public paths, and
the fault's threads call them. `submit=True` makes every stream also submit a one-token request with the real
`add_request` and abort it at once, so all three calls are timed from the fault's threads (`storm.calls`,
`storm.latency_frame()`). Those tiny requests are real: when the engine drains one before its abort it joins a
step's batch, so these runs' answers are not compared with anything.
"""),
        code("""
def real_paths(eng):
    # The storm with submit=True: the step's lock wait share, call latencies from the fault's threads, lock rows.
    wb_m = Workbench(eng, log=False).attach("lock_contention")
    with faults.inject(eng, "lock_storm", submitters=16, submit=True) as st:
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
"""),
        md("""
With the global lock, all three calls and the step queue on one lock: the p99s are tens of milliseconds, and the
step spends most of its time waiting. (The global medians are low because a stream re-takes the lock it has just
released, and Python's locks are not fair; the p99 is what everyone else sees.) Sharded, the step's wait share is
zero and `stats()` takes microseconds. `add_request` and `abort` still wait sometimes, but for a *shard*: 16 streams
share 8 shards and each holds its shard across a 5 ms copy most of the time, so a request landing on a busy shard
waits for another stream's copy. That is stream against stream inside one lock domain, never the step; more
domains (one per stream, as in the field note) would remove it. Where each call went:
"""),
        code("""
fig = px.bar(paths, x="call", y="p99_ms", color="page_table_lock", barmode="group", log_y=True,
             labels={"p99_ms": "p99 latency (ms, log)"},
             title="the engine's real paths, called by the storm's threads: p99 latency")
fig
"""),
        code("""
real_sites = ["engine.py add_request", "engine.py abort", "engine.py stats"]
where = pd.concat([g_frame.assign(page_table_lock="global"), s_frame.assign(page_table_lock="sharded")])
where = where[where.site.isin(real_sites)]
where.assign(lock=where.lock.str.replace(r"\\[\\d+\\]", "[shard]", regex=True)).groupby(
    ["page_table_lock", "site", "lock"])[["count", "contended", "wait_p99_ms"]].agg(
    {"count": "sum", "contended": "sum", "wait_p99_ms": "max"}).round(2)
"""),
        md("""
What moved off the step's lock: `stats()` now takes no lock at all (a snapshot read), `add_request` and `abort`
take only their request's shard (`page_table[shard]` rows), and `page_table` is taken by the engine thread alone
(the step's sections and applying an abort), so nobody can make the step wait.

## 8. Checks
The fault is caught (an error on lock `page_table` naming the storm's call site, with the sharding hint); the
answers are unchanged; with sharded locks the same storm leaves the probe silent; the engine's own
`add_request` / `abort` / `stats()` queue on the step's lock with the global lock and never touch it sharded.
"""),
        code("""
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
"""),
    ]


# ---------------------------------------------------------------------------------------
def lock_inversion():
    return [
        md("""
# lock_inversion: the engine hangs, requests stay "waiting" forever

**What production saw** (field note 6): *"batch 16, the first 10 requests fine, the last 6 stuck forever
'waiting'"*; the public twin is vllm #45387, a scheduler deadlock that shows as *Running=0 Waiting=N*. No error, no
crash, no log line: the service simply stops answering.

Here two stream threads take the engine's `page_table` lock and a `stream_context` lock in opposite orders; the
engine's next step then blocks behind them. The lock probe's watchdog notices the step past its deadline and
names the cycle.
"""),
        code(SETUP + """import threading

import plotly.graph_objects as go

from workbench.locks import InstrumentedLock
"""),
        code(catalogue_row("lock_inversion")),
        md(f"""
## 1. The engine, the probe and the first requests
SmolLM2-135M-Instruct.

{ENGINE_NOTE}

The probe's watchdog reports any step that runs past `deadline_s` (5 s
here: far above a healthy step on this model, short enough to wait for).
"""),
        code("""
engine = Engine.from_default(EngineConfig(num_pages=256, num_threads=1))
# No event log needed here: the probe keeps its own rows.
wb = Workbench(engine, log=False).attach("lock_contention", lock_contention={"deadline_s": 5.0})
params = SamplingParams(max_tokens=16, temperature=0.0)

first = ["What is the capital of France?", "Name three primary colours."]
for q, o in zip(first, engine.generate([[{"role": "user", "content": q}] for q in first], params)):
    print(f"Q: {q}\\nA: {o.text.strip()}\\n")
assert not wb.findings_at_least("warn")
"""),
        md("""
## 2. The symptom: six more requests arrive, and nothing happens
The engine steps on its own thread (as a server's loop would). With the fault on, its step blocks at its first
`page_table` acquire and never returns. We read the queue straight from the scheduler: `engine.stats()` itself
takes `page_table` with the default global lock, so it would hang too.
"""),
        code("""
late = ["What is the largest ocean on Earth?", "What colour is the sky on a clear day?", "Give me a synonym for happy.",
        "Write one sentence about the sea.", "How many legs does a spider have?", "Name a large planet."]
late_ids = [engine.add_request([{"role": "user", "content": q}], params) for q in late]
box = {}
server = threading.Thread(target=lambda: box.setdefault("out", engine.step()), name="engine", daemon=True)

with faults.inject(engine, "lock_inversion") as fault:
    server.start()
    give_up = time.monotonic() + 60
    while not wb.findings_at_least("critical") and time.monotonic() < give_up:
        time.sleep(0.1)
    hung = server.is_alive()
    queue = {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting)}
    caught = wb.findings_at_least("critical")
print("deadlock set up:", fault.deadlocked, "| engine step still running:", hung, "|", queue)
"""),
        md("""
*Running=0 Waiting=6*, exactly the production picture. Leaving the with-block switches the fault off: it breaks
the deadlock from a controlled path (releases `stream_context` on stream-B's behalf), the stuck step completes
and the six requests are served.
"""),
        code("""
server.join(30)
answers = {o.request_id: o for o in box.get("out", [])}
while engine.has_unfinished():
    answers.update({o.request_id: o for o in engine.step()})
for q, rid in zip(late, late_ids):
    print(f"Q: {q}\\nA: {answers[rid].text.strip()}\\n")
"""),
        md("""
## 3. The finding
One `critical` finding for the stuck step: which thread is stuck, on which lock, who holds it, and the
wait-for cycle.
"""),
        code("""
f = caught[0]
print(f.message)
print("\\nhint:", f.hint)
"""),
        code("""
pd.DataFrame(f.evidence["locks"])
"""),
        md("""
## 4. The view: the wait-for graph at the moment of the hang
Threads are circles, locks squares; an arrow thread -> lock means *waits for*, lock -> thread *held by*. The red
arrows close the cycle; the engine thread waits *behind* it, outside the cycle, which is why it can never
proceed.
"""),
        code("""
def wait_for_figure(edges, cycle_threads):
    threads = sorted({e["waiter_name"] for e in edges} | {e["holder_name"] for e in edges if e["holder_name"]})
    locks = sorted({e["lock"] for e in edges})
    nodes = [("thread", t) for t in threads] + [("lock", k) for k in locks]
    pos = {n: (i % 2 * 2.0 if n[0] == "thread" else 1.0, -(i // 2 if n[0] == "thread" else i - len(threads)))
           for i, n in enumerate(nodes)}
    fig = go.Figure()
    arrows = set()
    for e in edges:
        red = e["waiter_name"] in cycle_threads and e["holder_name"] in cycle_threads
        arrows.add((("thread", e["waiter_name"]), ("lock", e["lock"]), red))
        if e["holder_name"]:
            arrows.add((("lock", e["lock"]), ("thread", e["holder_name"]), red))
    for a, b, red in arrows:
        fig.add_annotation(x=pos[b][0], y=pos[b][1], ax=pos[a][0], ay=pos[a][1], xref="x", yref="y",
                           axref="x", ayref="y", showarrow=True, arrowhead=3, arrowwidth=2, standoff=22,
                           startstandoff=22, arrowcolor="crimson" if red else "grey")
    fig.add_trace(go.Scatter(
        x=[pos[n][0] for n in nodes], y=[pos[n][1] for n in nodes], mode="markers+text",
        text=[n[1] for n in nodes], textposition="bottom center", hoverinfo="text",
        marker=dict(size=34, symbol=["circle" if k == "thread" else "square" for k, _ in nodes],
                    color=["#4c78a8" if k == "thread" else "#f58518" for k, _ in nodes])))
    fig.update_layout(title="wait-for graph (red: the deadlock cycle)", showlegend=False, height=420,
                      xaxis=dict(visible=False, range=[-0.6, 2.6]), yaxis=dict(visible=False, range=[-2.2, 0.6]))
    return fig


wait_for_figure(f.evidence["wait_for"], f.evidence["cycle_threads"])
"""),
        md("""
The stacks in the evidence show where each thread stopped (the last frames of stream-A):
"""),
        code("""
stack_a = next(v for k, v in f.evidence["stacks"].items() if k.startswith("stream-A "))
print("".join(stack_a.splitlines(keepends=True)[-6:]))
"""),
        md("""
## 5. Root cause
A lock-order inversion. stream-A updates its page table (holds `page_table`) and then needs its stream context;
stream-B holds its stream context and then needs `page_table`. Each waits for the other forever, and because
`page_table` is the lock the engine's step takes first, the whole engine stops: nothing is scheduled, every new
request sits in `waiting`. The field note's "last 6 stuck" are the requests that arrived after the cycle formed.

## 6. The fix: one global lock order
Every thread takes `page_table` first and `stream_context` second (or each stream gets a lock domain of its own,
see the lock_storm notebook). The same two streams, written with the one order, run beside the engine while it
serves new requests:
"""),
        code("""
stream_context = InstrumentedLock("stream_context", engine.bus, lambda: engine.step_count)
LOCK_ORDER = (engine.lock, stream_context)        # page_table, then stream_context: in every thread


def stream(updates=200):
    for _ in range(updates):
        with LOCK_ORDER[0]:
            with LOCK_ORDER[1]:
                pass                               # the table update and the context switch
        time.sleep(0.001)


wb.reset()
streams = [threading.Thread(target=stream, name=f"stream-{x}", daemon=True) for x in "AB"]
for t in streams:
    t.start()
again = engine.generate([[{"role": "user", "content": q}] for q in late[:3]], params)
for t in streams:
    t.join(60)
print("streams done:", not any(t.is_alive() for t in streams))
print("answers unchanged:", [o.text for o in again] == [answers[r].text for r in late_ids[:3]])
wb.findings
"""),
        md("""
## 7. Checks
The hang is real and caught as a deadlock over exactly these two locks and two threads; the fault leaves the
engine clean; with one lock order the same streams run beside the engine and the probe stays silent.
"""),
        code("""
assert fault.deadlocked and hung and queue == {"running": 0, "waiting": len(late)}
assert caught and f.probe == "lock_contention" and f.kind == "deadlock" and f.severity == "critical"
assert set(f.evidence["cycle_locks"]) == {"page_table", "stream_context"}
assert set(f.evidence["cycle_threads"]) == {"stream-A", "stream-B"}
for name in ("page_table", "stream_context", "stream-A", "stream-B", "'engine'"):
    assert name in f.message, name
assert "one global order" in f.hint
assert not server.is_alive() and all(answers[r].finished for r in late_ids)
assert not engine.lock.locked()

assert not any(t.is_alive() for t in streams)
assert [o.text for o in again] == [answers[r].text for r in late_ids[:3]]
assert not wb.findings_at_least("warn"), wb.findings
wb.detach()
"""),
    ]


# ---------------------------------------------------------------------------------------
def buffer_leak():
    return [
        md("""
# buffer_leak: memory grows every step until the process is killed

**What production saw** (field note 7): *"a new cu_seqlens tensor every step, never released by the runtime's
lazier GC: OOM after ~24 h. Fix: one preallocated buffer, filled in place: flat memory for 72 h."* Public:
sglang #5375, *~500 MB per node in 3 h*. And: *watch RssAnon + VmSwap, not RSS alone*.

Outputs stay correct the whole time; the only symptom is memory, and only over hours. The leak probe finds it in
a few dozen steps by naming the per-step tensors that stay alive.
"""),
        code(SETUP + """import ctypes
import gc
"""),
        code(catalogue_row("buffer_leak")),
        md(f"""
## 1. The engine and a healthy baseline
SmolLM2-135M-Instruct with a large step token budget (`max_num_batched_tokens=32768`), so each step's metadata
workspace is ~0.9 MB, as a runtime sized for long prompts allocates it: the leak shows in seconds rather than
hours.

{ENGINE_NOTE}

The leak probe samples memory every step here (`every=1`; production default: every 16th) and wants 16 samples
of steady growth.
"""),
        code("""
engine = Engine.from_default(EngineConfig(num_pages=256, num_threads=1, max_num_batched_tokens=32768))
questions = ["What is the capital of France?", "Write a short poem about the sea.",
             "Name three primary colours.", "Explain in two sentences why the sky is blue."]
prompts = [[{"role": "user", "content": q}] for q in questions]
params = SamplingParams(max_tokens=28, temperature=0.0)
engine.generate(prompts, SamplingParams(max_tokens=4))        # loads the tokenizer, warms up the shapes

LEAK = dict(every=1, window=16, min_growth_bytes=4 << 20, retain_window=16, census_every=8, min_tensor_growth=32)
wb = Workbench(engine, log=False).attach("leak", leak=LEAK)     # no event log: it would grow too
clean_outs = engine.generate(prompts, params)
for q, o in zip(questions, clean_outs):
    print(f"Q: {q}\\nA: {o.text.strip()}\\n")
clean = wb.probe("leak").frame()
clean_findings = wb.findings_at_least("warn")
print("retained per-step tensors:", clean["retained_tensors"].max())
wb.findings
"""),
        md("""
## 2. The symptom: the same requests with the leak on
`faults.inject(engine, "buffer_leak")` wraps the batch builder so every step's index tensors (`cu_seqlens_q/k`,
`slot_mapping`, positions, block tables, ...) are fresh allocations at the workspace's full size, appended to the
runtime's pending-free list that never drains. First we hand freed heap back to the OS, so RssAnon measures new
memory rather than old chunks the leak would quietly reuse.
"""),
        code("""
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
"""),
        md("""
## 3. The findings
The probe keeps a weak reference to every per-step batch tensor that is *not* a view of the builder's
preallocated buffers; one still alive from every step of its window is an error that names the fields and who
holds them. The RssAnon + VmSwap series confirms the growth, with the rate extrapolated to a day.
"""),
        code("""
wb.findings[["probe", "severity", "kind", "step", "message"]]
"""),
        code("""
caught = {f.kind: f for f in wb.findings_at_least("error")}
for f in caught.values():
    print(f"[{f.severity}] {f.kind}: {f.message}\\n  hint: {f.hint}\\n")
"""),
        md("""
## 4. The view: memory per step
The process's anonymous memory (RssAnon + VmSwap, relative to the first sample) and the bytes of retained
per-step tensors, step by step (`wb.probe("leak").frame()`).
"""),
        code("""
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
"""),
        md("""
## 5. Root cause
The batch builder is meant to fill one preallocated buffer per index tensor in place every step. The faulty path
allocates a new tensor per step instead; in eager PyTorch that is only churn, but a runtime with a lazier
allocator/GC (the field note's, sglang's) keeps each one alive, so memory climbs by the workspace size every step:
at a few steps per second that is gigabytes a day, and the process is killed after about a day. RSS alone can
hide it (file pages come and go); RssAnon + VmSwap does not.

## 6. The fix: one buffer per index tensor, filled in place
That is the engine's own `BatchBuilder` (its `_Buffer`s): leaving the with-block restores it. Every index tensor
of a batch is then a view of the same storage, step after step:
"""),
        code("""
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
"""),
        code("""
wb.findings
"""),
        md("""
## 7. Checks
The leak is caught and named (the retained `cu_seqlens_q` and friends, held by the fault's pending-free list),
memory really grew, answers never changed, and the fixed builder leaves the probe silent.
"""),
        code("""
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
"""),
    ]


# ---------------------------------------------------------------------------------------
def slow_page_size():
    return [
        md("""
# slow_page_size: throughput halves after an upgrade, outputs unchanged

**What production saw** (field note 8): *"after a runtime upgrade, throughput 79 -> 42 tokens/s: the new kernel
path requires page_size a power of two >= 16; page_size 12 silently fell back to a slow path. Fix: validate at
start-up."* Nothing failed and every answer was right; only the dashboards moved.

Here the fault re-pages an idle engine to `page_size=12` with the same KV memory, the way
`EngineConfig(page_size=12, allow_unsupported_page_size=True)` would build it: no paged kernel takes that size, so
attention runs the generic fallback. The bandwidth probe's config check names it.
"""),
        code(SETUP),
        code(catalogue_row("slow_page_size")),
        md(f"""
## 1. The engine and a healthy baseline
SmolLM2-135M-Instruct with 16-token pages.

{ENGINE_NOTE}

Three short questions and one long one (a pasted
text of about 500 tokens to summarise), so attention has real context to read.

Time is measured two ways: wall clock, and this process's CPU time (one torch thread, so CPU time is the work
done, whatever else the machine is running).
"""),
        code(PARAGRAPH + """
questions = ["What is the capital of France?", "Name three primary colours.", "What is the largest ocean on Earth?",
             "Summarise in one sentence: " + paragraph * 10]
prompts = [[{"role": "user", "content": q}] for q in questions]
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
for q, o in zip(questions, clean_outs):
    print(f"Q: {q[:70]}\\nA: {o.text.strip()}\\n")
print(f"page_size {engine.config.page_size}, attention backend '{engine.attn.name}'")
wb.findings
"""),
        md("""
## 2. The symptom: the same requests after the "upgrade"
The fault swaps in a pool, KV cache, block tables and batch buffers for 12-token pages, and the backend
`get_backend` picks for that size.
"""),
        code("""
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
"""),
        md("""
Same answers, slower. The last column: what the paged kernel reads (whole pages of the context) against what the
fallback gathers (every context token of every row, padded to the longest, plus the slot indices).

## 3. The finding
The bandwidth probe checks the configuration at attach and whenever the page size changes, and judges each
step's achieved bandwidth against the machine's measured peak.
"""),
        code("""
wb.findings[["probe", "severity", "kind", "step", "message"]]
"""),
        code("""
caught = [f for f in slow_findings if f.at_least("error")]
print(caught[0].message)
print("\\nhint:", caught[0].hint)
"""),
        md("""
## 4. The view: step time, before and after
Every step of both runs (`wb.probe("bandwidth").frame()`): step for step the fallback is slower, and its decode
steps reach a smaller share of the memory-bandwidth roof.
"""),
        code("""
both = pd.concat([clean.assign(run="page_size 16", i=range(len(clean))),
                  slow.assign(run="page_size 12", i=range(len(slow)))])
both["ms"] = both["seconds"] * 1000
px.bar(both, x="i", y="ms", color="run", barmode="group", log_y=True,
       hover_data=["step", "tokens", "gbs", "share_of_peak"],
       labels={"i": "step of the run"}, title="step time (log scale): page_size 16 vs 12")
"""),
        code("""
px.box(both[both["decode_only"]], x="run", y="share_of_peak", points="all",
       title="decode steps: achieved share of the measured peak bandwidth")
"""),
        md("""
## 5. Root cause
Paged kernels (Ascend PagedAttention, FlashAttention's paged KV) find a token's page and offset with a shift and a
mask, so they take only power-of-two page sizes (Ascend: multiples of 16, 128 recommended). For 12 the runtime
silently picks a generic path: no per-step plan, a division and modulo per token per layer, K/V gathered token by
token for the whole (padded) context, KV heads expanded to the query heads. The output is identical; the work is
not.

## 6. The fix: a supported page size, validated at start-up
Use 16, 32, 64 or 128. `EngineConfig` validates it, so the bad size never reaches a running service:
"""),
        code("""
try:
    EngineConfig(page_size=12)
except ConfigError as e:
    rejected = str(e)
print(rejected)
"""),
        md("""
Leaving the with-block put the engine back on its 16-token pool and the paged kernel. The same requests again:
"""),
        code("""
wb.reset()
fixed_outs, fixed_s, fixed_cpu = timed_generate()
print(f"page_size {engine.config.page_size}, backend '{engine.attn.name}': {tokens / fixed_s:.1f} tokens/s")
print("answers unchanged:", [o.text for o in fixed_outs] == [o.text for o in clean_outs])
wb.findings
"""),
        md("""
## 7. Checks
The page size is caught as an error naming `page_size=12` and the fallback, with the supported sizes as the
hint; the fallback really does more work (bytes it counted; CPU time of one thread, a large effect rather than a
close timing); the fixed engine is back on the paged kernel and the probe is silent.
"""),
        code("""
assert not clean_findings, clean_findings
assert slow_config[0] == 12 and slow_config[2] == "torch-fallback"
assert caught, "slow_page_size was not caught"
f = caught[0]
assert f.probe == "bandwidth" and f.kind == "page-size"
assert "page_size=12" in f.message and "torch-fallback" in f.message and "16, 32, 64 or 128" in f.hint
assert [o.text for o in slow_outs] == [o.text for o in clean_outs]
assert gathered > 1.5 * clean["bytes_kv_read"].sum()          # counted bytes, not time
assert slow_cpu > 1.25 * clean_cpu, (slow_cpu, clean_cpu)

assert "page_size=12" in rejected and "16, 32, 64 or 128" in rejected
assert engine.config.page_size == 16 and engine.attn.name != "torch-fallback"
assert [o.text for o in fixed_outs] == [o.text for o in clean_outs]
assert not wb.findings_at_least("warn"), wb.findings
wb.detach()
"""),
    ]


# ---------------------------------------------------------------------------------------
def pool_pressure():
    return [
        md("""
# pool_pressure: preemption storms and OOM on long-tail traffic

**What production saw** (field note 10): the KV pool was sized from the wrong length. The rule that fixed it:
*"max_pages = ceil(batch x P99 length / page_size) x 1.3. Size from production's P99 length, not the training
max_len: a service with max_len 2048 but 99% of requests under 512 needs 2,048 pages, not 16,384 (1.1 GB saved,
table set-up 4.7x faster)."* Sized too small instead, the long tail fills the pool: the scheduler preempts and
recomputes request after request, or stalls outright (the OOM). Operators alert at *used ratio > 0.95*
(field note 13).

Here the fault takes pages out of the live pool, so only 15% of it is left to requests, and long-tail chat
traffic runs on it. The pool probe names the pressure and computes the size from what it saw.
"""),
        code(SETUP + """
from probes.pool import advise_pool_size
"""),
        code(catalogue_row("pool_pressure")),
        md(f"""
## 1. The engine and long-tail traffic
SmolLM2-135M-Instruct with a 128-page pool of 16 tokens.

{ENGINE_NOTE}

Sixteen chat requests at once: fourteen
short questions and a tail of two that paste two and four paragraphs to summarise.
"""),
        code(PARAGRAPH + """
short = ["What is the capital of France?", "Name three primary colours.", "Write one sentence about the sea.",
         "What is the largest ocean on Earth?", "What colour is the sky on a clear day?",
         "Give me a synonym for happy.", "How many legs does a spider have?", "What is the boiling point of water?",
         "Name a fruit that is yellow.", "What language is spoken in Brazil?", "Who wrote Romeo and Juliet?",
         "What is the opposite of cold?", "Name a mammal that can fly.", "How many days are in a week?"]
questions = short + ["Summarise in one sentence: " + paragraph * k for k in (2, 4)]     # the long tail
prompts = [[{"role": "user", "content": q}] for q in questions]
params = SamplingParams(max_tokens=32, temperature=0.0)

engine = Engine.from_default(EngineConfig(num_pages=128, num_threads=1))
engine.generate(["Hello"], SamplingParams(max_tokens=1))      # loads the tokenizer, warms up
lengths = [len(engine.tokenizer.apply_chat_template(p)) for p in prompts]
print("prompt lengths (tokens):", lengths)
"""),
        md("""
## 2. The symptom: preemptions
With the fault on, 15% of the pool is usable. Every request still gets an answer, but the scheduler admits by
free pages, the running requests grow as they decode, and whenever the next page is missing the newest request
is preempted and later recomputed from scratch.
"""),
        code("""
wb = Workbench(engine).attach("pool", pool={"storm_threshold": 3})
with faults.inject(engine, "pool_pressure", usable=0.15) as fault:
    usable = engine.pool.num_free
    pressured = engine.generate(prompts, params)          # runs to completion inside the with-block
print(f"{usable} of {engine.num_pages} pages usable; {engine.stats()['num_preemptions']} preemptions")
pd.DataFrame({"prompt tokens": lengths, "preemptions": [o.num_preemptions for o in pressured],
              "answer": [o.text.strip()[:70] for o in pressured]})
"""),
        md("""
Which requests were preempted, and when (`wb.log.frame("RequestPreempted")`; the probe is set to call three
preemptions within 16 steps a storm, for a demo this small):
"""),
        code("""
wb.log.frame("RequestPreempted")[["step", "request_id"]]
"""),
        md("""
## 3. The findings
Usage above the 0.95 alert for three steps is an error whose hint is the sizing rule applied to the traffic seen
so far; a burst of preemptions is a storm; pages held outside every live sequence (the part of the pool the fault
took) are named too.
"""),
        code("""
wb.findings[["probe", "severity", "kind", "step", "request_id", "message"]]
"""),
        code("""
caught = {f.kind: f for f in wb.findings_at_least("error")}
print(caught["pool-usage"].message)
print("\\nhint:", caught["pool-usage"].hint)
"""),
        md("""
## 4. The view: pool usage and preemptions per step
From `wb.probe("pool").frame()`: used share of the pool against the 0.95 alert line, and the steps with
preemptions.
"""),
        code("""
def pool_view(df, title):
    fig = px.line(df, x="step", y="usage", title=title, range_y=[0, 1.05],
                  hover_data=["pages_used", "pages_total", "live_seqs", "waiting"])
    fig.add_hline(y=0.95, line_dash="dash", line_color="crimson", annotation_text="alert 0.95")
    hit = df[df["preemptions"] > 0]
    fig.add_scatter(x=hit["step"], y=hit["usage"], mode="markers", name="preemption",
                    marker=dict(color="crimson", size=11, symbol="x"))
    return fig


pressure = wb.probe("pool").frame()
pool_view(pressure, "15% of the pool usable: usage and preemptions")
"""),
        md("""
## 5. Root cause
The pool was sized for a typical request, not for the tail. Paged KV allocates pages on demand, so short requests
fit many at once, but a few long prompts take most of the pool, and every running request needs a new page every
16 tokens it generates. With no headroom the scheduler's only move is to preempt (free the newest request's pages
and recompute it later): throughput goes to recomputation, and a request longer than the usable pool can never
run at all (the OOM).

## 6. The fix: size the pool from production's P99 length
`ceil(batch x P99 length / page_size) x 1.3`. The probe applies the rule to the lengths the requests reached and
the most requests that were in flight at once; `advise_pool_size` is the rule itself. (The finding's hint applied
it at the moment of the alert, to the requests running then; the long tail was still queued. Now the probe has
seen the whole traffic.)
"""),
        code("""
advice = wb.probe("pool").sizing()
rule = advise_pool_size([n + params.max_tokens for n in lengths], max_batch=len(prompts), page_size=16)
print(advice)
print("the rule over prompt + max_tokens for all", len(prompts), "requests at once:", rule, "pages")
"""),
        md("""
A pool of the advised size, the same traffic:
"""),
        code("""
fixed = Engine.from_default(EngineConfig(num_pages=advice["pages"], num_threads=1))
fixed.tokenizer = engine.tokenizer         # the same model file: reuse the tokenizer already loaded
wb_fixed = Workbench(fixed, log=False).attach("pool", pool={"storm_threshold": 3})
fixed_outs = fixed.generate(prompts, params)
sized = wb_fixed.probe("pool").frame()
print(f"{fixed.num_pages} pages: {fixed.stats()['num_preemptions']} preemptions, peak usage {sized['usage'].max():.0%}")
print("answers unchanged:", [o.text for o in fixed_outs] == [o.text for o in pressured])
pool_view(sized, f"advised pool ({fixed.num_pages} pages): usage")
"""),
        code("""
wb_fixed.findings
"""),
        md("""
## 7. Checks
The pressure is caught as an error over the 0.95 alert with the sizing hint, preemptions really happened (and
recompute kept every answer right), the pages went back when the fault was switched off, and the advised pool
runs the same traffic without a preemption or a finding.
"""),
        code("""
usage = caught["pool-usage"]
assert usage.probe == "pool" and usage.severity == "error" and usage.evidence["usage"] > 0.95
assert "EngineConfig(num_pages=" in usage.hint and f"{usable} of them usable" in usage.hint
assert sum(o.num_preemptions for o in pressured) > 0 and pressure["preemptions"].sum() > 0
assert engine.pool.num_free == engine.num_pages and fault.reserved == []

assert advice["pages"] > usable
assert fixed.stats()["num_preemptions"] == 0 and sized["usage"].max() < 0.95
assert [o.text for o in fixed_outs] == [o.text for o in pressured]
assert not wb_fixed.findings_at_least("warn"), wb_fixed.findings
wb.detach()
wb_fixed.detach()
"""),
    ]


NOTEBOOKS = {"lock_storm": lock_storm, "lock_inversion": lock_inversion, "buffer_leak": buffer_leak,
             "slow_page_size": slow_page_size, "pool_pressure": pool_pressure}


def write(name: str) -> Path:
    nb = new_notebook(cells=NOTEBOOKS[name]())
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    path = OUT / f"{name}.ipynb"
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    import sys
    for name in sys.argv[1:] or NOTEBOOKS:
        print(write(name))
