# %% [markdown]
# # lock_inversion: the engine hangs, requests stay "waiting" forever
#
# **What production saw** (field note 6): *"batch 16, the first 10 requests fine, the last 6 stuck forever
# 'waiting'"*; the public twin is vllm #45387, a scheduler deadlock that shows as *Running=0 Waiting=N*. No error, no
# crash, no log line: the service simply stops answering.
#
# Here two stream threads take the engine's `page_table` lock and a `stream_context` lock in opposite orders; the
# engine's next step then blocks behind them. The lock probe's watchdog notices the step past its deadline and
# names the cycle.

# %%
import threading
import time

import pandas as pd
import plotly.graph_objects as go

from workbench import Engine, EngineConfig, SamplingParams, Workbench, faults
from workbench.lab import chat, show_answers, show_fault
from workbench.locks import InstrumentedLock

pd.set_option("display.max_colwidth", 160)

# %%
show_fault("lock_inversion")

# %% [markdown]
# ## 1. The engine, the probe and the first requests
# SmolLM2-135M-Instruct.
#
# `num_threads=1`: one torch thread. On a small shared machine two OpenMP threads spin against each other and every step gets many times slower; SmolLM2-135M loses little without the second.
#
# The probe's watchdog reports any step that runs past `deadline_s` (5 s
# here: far above a healthy step on this model, short enough to wait for).

# %%
engine = Engine.from_default(EngineConfig(num_pages=256, num_threads=1))
# No event log needed here: the probe keeps its own rows.
wb = Workbench(engine, log=False).attach("lock_contention", lock_contention={"deadline_s": 5.0})
params = SamplingParams(max_tokens=16, temperature=0.0)

first = ["What is the capital of France?", "Name three primary colours."]
show_answers(first, engine.generate(chat(first), params))
assert not wb.findings_at_least("warn")

# %% [markdown]
# ## 2. The symptom: six more requests arrive, and nothing happens
# The engine steps on its own thread (as a server's loop would). With the fault on, its step blocks at its first
# `page_table` acquire and never returns. We read the queue straight from the scheduler: `engine.stats()` itself
# takes `page_table` with the default global lock, so it would hang too.

# %%
late = ["What is the largest ocean on Earth?", "What colour is the sky on a clear day?", "Give me a synonym for happy.",
        "Write one sentence about the sea.", "How many legs does a spider have?", "Name a large planet."]
late_ids = [engine.add_request(prompt, params) for prompt in chat(late)]
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

# %% [markdown]
# *Running=0 Waiting=6*, exactly the production picture. Leaving the with-block switches the fault off: it breaks
# the deadlock from a controlled path (releases `stream_context` on stream-B's behalf), the stuck step completes
# and the six requests are served.

# %%
server.join(30)
answers = {o.request_id: o for o in box.get("out", [])}
while engine.has_unfinished():
    answers.update({o.request_id: o for o in engine.step()})
for q, rid in zip(late, late_ids):
    print(f"Q: {q}\nA: {answers[rid].text.strip()}\n")

# %% [markdown]
# ## 3. The finding
# One `critical` finding for the stuck step: which thread is stuck, on which lock, who holds it, and the
# wait-for cycle.

# %%
f = caught[0]
print(f.message)
print("\nhint:", f.hint)

# %%
pd.DataFrame(f.evidence["locks"])


# %% [markdown]
# ## 4. The view: the wait-for graph at the moment of the hang
# Threads are circles, locks squares; an arrow thread -> lock means *waits for*, lock -> thread *held by*. The red
# arrows close the cycle; the engine thread waits *behind* it, outside the cycle, which is why it can never
# proceed.

# %%
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

# %% [markdown]
# The stacks in the evidence show where each thread stopped (the last frames of stream-A):

# %%
stack_a = next(v for k, v in f.evidence["stacks"].items() if k.startswith("stream-A "))
print("".join(stack_a.splitlines(keepends=True)[-6:]))

# %% [markdown]
# ## 5. Root cause
# A lock-order inversion. stream-A updates its page table (holds `page_table`) and then needs its stream context;
# stream-B holds its stream context and then needs `page_table`. Each waits for the other forever, and because
# `page_table` is the lock the engine's step takes first, the whole engine stops: nothing is scheduled, every new
# request sits in `waiting`. The field note's "last 6 stuck" are the requests that arrived after the cycle formed.
#
# ## 6. The fix: one global lock order
# Every thread takes `page_table` first and `stream_context` second (or each stream gets a lock domain of its own,
# see the lock_storm notebook). The same two streams, written with the one order, run beside the engine while it
# serves new requests:

# %%
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

# %% [markdown]
# ## 7. Checks
# The hang is real and caught as a deadlock over exactly these two locks and two threads; the fault leaves the
# engine clean; with one lock order the same streams run beside the engine and the probe stays silent.

# %%
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
