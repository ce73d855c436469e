# %% [markdown]
# # Watch your vLLM
#
# The probes in the other notebooks watch the workbench's own engine. This one points them at a real
# vLLM: the engine you actually serve with. The workbench sees vLLM through three doors, all of them vLLM's own:
#
# - **the plugin.** Installing the workbench in vLLM's environment registers a `vllm.general_plugins` entry point.
#   vLLM loads it in each of its processes, and it does nothing unless `PAGEDKV_VLLM_SANITIZER` names an address
#   the workbench listens on. When it is on, it checks every step with the same invariants as our probes
#   (`probes/invariants.py`). It checks the attention metadata every backend receives (`block_table_tensor`,
#   `slot_mapping`, `positions`, `query_start_loc`, `seq_lens`) against each request's block ids, and it checks
#   vLLM's block pool (reference counts, the free queue, the prefix index, blocks nobody holds). It sends its
#   findings and a snapshot of the pool after each step;
# - **KV cache events** (`--kv-events-config`): BlockStored / BlockRemoved, so you know which prefix-cache blocks
#   vLLM holds right now;
# - **`/metrics`**: vLLM's own KV-cache usage, running / waiting, preemptions and prefix-cache hits.
#
# **On your own server** there are two settings to add, then connect from a notebook
# (`pip install pagedkv_workbench-*.whl`, built by `make wheel`, in vLLM's environment first):
#
# ```bash
# PAGEDKV_VLLM_SANITIZER=tcp://127.0.0.1:5590 \
# python -m vllm.entrypoints.openai.api_server --model ... --host 127.0.0.1 --enable-prefix-caching \
#   --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
#                        "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}'
# ```
#
# ```python
# wb = Workbench.connect_vllm(url="http://127.0.0.1:8000", kv_events="tcp://127.0.0.1:5557",
#                             sanitizer="tcp://127.0.0.1:5590", kv_replay="tcp://127.0.0.1:5558")
# wb.dashboard()
# ```
#
# Here we start our own server: vLLM's CPU build (`.venv-vllm`, installed by `make vllm`) serving SmolLM2-135M-Instruct
# with these two settings on. We send it clean traffic first, then plant a bug in vLLM's own metadata path and
# watch the plugin name the request and the block.

# %%
import atexit
import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd
from workbench import Workbench
from workbench.adapters.vllm.faults import write_fault_file
from workbench.adapters.vllm.server import VllmServer, free_port

pd.set_option("display.max_colwidth", None)                  # whole answers and messages

# %% [markdown]
# ## 1. Start a real vLLM, with the plugin and KV events on
# Every address is a free port on 127.0.0.1. The **fault file** is how this notebook plants a bug in vLLM later
# (the plugin's seams re-read it while the server runs). For now it names no fault.
#
# The workbench connects **before** vLLM starts. With `tcp://127.0.0.1` endpoints, the workbench binds the
# sanitizer and KV-event addresses and vLLM's processes connect to them. Binding first means nothing vLLM sends is
# missed. vLLM takes 30 to 80 s to start on this CPU.

# %%
work = Path(tempfile.mkdtemp(prefix="watch-your-vllm-"))
fault_file = str(work / "faults.json")
write_fault_file(fault_file)                                 # no fault planted
sanitizer, kv_events, kv_replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
server = VllmServer(sanitizer=sanitizer, kv_events=kv_events, kv_replay=kv_replay, fault_file=fault_file,
                    log_path=work / "vllm.log")              # SmolLM2, 32-token blocks, prefix caching
wb = Workbench.connect_vllm(url=server.url, kv_events=kv_events, sanitizer=sanitizer, kv_replay=kv_replay,
                            interval_s=0.5)
atexit.register(server.stop)                                 # never leave a vLLM behind, even if a cell fails
server.start()
print(f"vLLM up at {server.url} after {server.started_s:.0f} s; log: {server.log_path}")
print(" ".join(server.cmd[1:]))

# %% [markdown]
# The dashboard is the same page map as for our engine, fed by the plugin's snapshot after each step. Every
# cell is one of vLLM's blocks: grey when free, light blue when cached (free, but its prefix can still be
# reused), and in its request's colour while a request holds it. Hover over a cell to see its request. Next to the
# map are vLLM's `/metrics` timelines, and under it the plugin's findings. It refreshes twice a second. Watch it
# while the next cells run. A red line above the map says which door the workbench cannot read right now, and why.

# %%
dash = wb.dashboard()
dash

# %% [markdown]
# ## 2. Clean traffic: a burst of shared-prefix chats
# Twelve questions share one long system prompt (several 32-token blocks). Six are in flight at a time, as
# concurrent HTTP clients would send them. With prefix caching on, vLLM computes the shared blocks once and reuses
# them. The answers are greedy (`temperature=0`) and short, so any later change in the text comes from the fault.

# %%
SYSTEM = ("You are a helpful assistant for a team that runs paged-KV inference servers. Answer in one short, "
          "plain sentence, without lists. The team cares about memory, latency and correctness. ") * 3
QUESTIONS = [f"In a few words, what is {w}?" for w in
             ("a page table", "a prefix cache", "a GPU", "a token", "a scheduler", "a kernel",
              "a batch", "bandwidth", "a cache miss", "a mutex", "a memory leak", "a tensor")]


def ask(questions, workers=6, max_tokens=20):
    """Chat completions sent concurrently; returns (vLLM's response ids, the answers)."""
    return server.burst(questions, SYSTEM, workers=workers, max_tokens=max_tokens)


def wait_idle(timeout_s=30):
    """Until the plugin's latest snapshot shows vLLM with nothing running or waiting."""
    return wb.vllm.wait_idle(timeout_s)


t0 = time.time()
clean_ids, clean = ask(QUESTIONS)
print(f"{len(QUESTIONS)} requests in {time.time() - t0:.1f} s\n")
for q, a in list(zip(QUESTIONS, clean))[:3]:
    print(f"Q: {q}\nA: {a}\n")
wait_idle()
print(wb.vllm.summary_line())

# %% [markdown]
# ### What the plugin saw
# On a healthy vLLM the plugin finds nothing: no finding of severity `warn` or above. It checked the metadata of
# every step's attention and the block pool after every step.

# %%
assert wb.findings_at_least("warn") == [], wb.findings
wb.findings

# %% [markdown]
# The two outside doors agree with the plugin. The KV-event map (blocks vLLM reported stored and not yet removed)
# holds exactly as many blocks as the pool holds with a prefix hash. The plugin counts those in the pool itself.
# vLLM's `/metrics` show the shared system prompt hitting the prefix cache.

# %%
st = wait_idle()
t0 = time.time()
while len(wb.vllm.kv.stored) != st["hashed"] and time.time() - t0 < 5:    # the last KV-event batch in flight
    time.sleep(0.2)
    st = wb.vllm.sanitizer.steps[-1]
m = wb.vllm.metrics.rows[-1]
print(f"KV-event map: {len(wb.vllm.kv.stored)} blocks; pool: {st['hashed']} hashed blocks of {st['num_blocks']}")
print(f"prefix cache: {m['prefix_hits']:.0f} of {m['prefix_queries']:.0f} queried tokens hit")
assert len(wb.vllm.kv.stored) == st["hashed"] > 0 and not wb.vllm.kv.gaps
assert m["prefix_hits"] > 0

# %% [markdown]
# ## 3. Plant a bug in vLLM's own metadata path
# Production bug: **the block table the kernel reads has two rows swapped.** This is what a `condense` or
# `swap_states` of the input batch does when it moves one copy of a request's row and not the other. Each of the
# two requests then attends over the other one's KV blocks. Nothing crashes, and paged-attention kernels do not
# check whose block they read, so the answers just come out wrong.
#
# `write_fault_file(path, "permuted_block_table_rows")` switches it on in the running server. vLLM's worker
# re-reads the file, and from then on every step's `block_table_tensor` has rows 0 and 1 swapped before the
# attention backend builds from it. The first six questions again, all six in flight:

# %%
write_fault_file(fault_file, "permuted_block_table_rows")
time.sleep(0.5)                                              # every vLLM process re-reads the file
broken_ids, broken = ask(QUESTIONS[:6])
wait_idle()
pd.DataFrame({"question": QUESTIONS[:6], "clean": clean[:6], "rows 0 and 1 swapped": broken})

# %%
changed = [q for q, a, b in zip(QUESTIONS, clean, broken) if a != b]
print(f"{len(changed)} of 6 answers changed: {changed}")
assert changed, "the planted fault did not change any answer"

# %% [markdown]
# ### What the plugin found
# For every step, the plugin rebuilds the block table the kernel should read from each scheduled request's own
# block ids (the runner's record of what the scheduler decided) and compares it with `block_table_tensor`. The
# finding names the step, the row and column, the block the kernel would read instead of the one the request owns,
# and vLLM's id for the request.

# %%
errors = wb.findings_at_least("error")                       # none before the fault (checked above)
assert errors, "the plugin did not catch the swapped block-table rows"
wb.findings.query("severity in ('error', 'critical')")[["probe", "kind", "step", "request_id", "page", "message"]]

# %%
f = next(f for f in errors if f.kind == "block-table")
question = next(q for q, rid in zip(QUESTIONS, broken_ids) if str(f.request_id).startswith(rid))
print(f"{f.message}\n\nrequest {f.request_id}\n  asked: {question!r}\n  block read: {f.evidence['got']}, "
      f"its own: {f.evidence['want']}\nfix: {f.hint}")
assert f.page == f.evidence["got"] != f.evidence["want"]

# %% [markdown]
# ### The finding in the page map
# In the dashboard's findings list, set **at least** to `error` and click a finding. The page map then rings in
# red the two blocks that finding names: the block the kernel read, which belongs to the other request in the
# swap, and the block the request owns there.
# vLLM's dashboard shows the pool live, with no time travel, so the ring sits on that block as it is now. Once the
# requests have finished it is a cached prefix block, light blue. The next cell makes the same two clicks from code
# and shows the dashboard again here.

# %%
dash.findings.severity.value = "error"                       # the list's "at least" filter
picked = dash.findings.select(0)                             # what a click on its first row does
print(f"{picked['kind']}: {picked['message']}\nringed: {dash.page_map.highlight}")
assert dash.page_map.highlight == picked["pages"] and picked["page"] in dash.page_map.highlight
dash

# %% [markdown]
# ### What attention computed
# The plugin also checks the attention math itself, one layer and one request row a step: the backend's output
# for that row against float32 attention over the request's own stored K/V, read through the blocks the ledger
# says it owns. With the rows swapped, the kernel attended over another request's blocks, so the outputs
# differ. Such an `attention-read` finding carries a picture: per wrong query head, the attention weights over
# the context the model means (want) and, when an explanation reproduced the kernel's output, the weights the
# kernel attended with (got). The dashboard's findings list draws it under the finding's details; here it is
# drawn directly.

# %%
from probes.attention_picture import attention_figure

reads = [f for f in wb.findings_at_least("error") if f.probe == "vllm_attention" and f.kind == "attention-read"]
assert reads, "the attention check did not see the swapped rows"
print(reads[0].message)
attention_figure(reads[0])

# %% [markdown]
# ## 4. Switch it off: sane answers again
# `write_fault_file(path)` with no fault names switches it off. One thing the fault may leave behind is the prefix
# cache. The swap never touched `slot_mapping`, so every token's KV went to its own block, but the KV of tokens
# computed while the fault was on was computed over the wrong context. vLLM's prefix cache finds blocks by their
# tokens alone, so a later request with the same prefix would reuse those blocks. Here that cannot happen: the clean
# burst had already cached every full block of these prompts, and the broken run read those blocks instead of
# writing new ones. On a real server, after a bug like this, empty the prefix cache (`POST /reset_prefix_cache`,
# served when vLLM runs with `VLLM_SERVER_DEV_MODE=1`) or restart it. Ask the same six questions again:

# %%
write_fault_file(fault_file)
time.sleep(0.5)
after_fault = len(wb.vllm.findings)
fixed_ids, fixed = ask(QUESTIONS[:6])
wait_idle()
pd.DataFrame({"question": QUESTIONS[:6], "clean": clean[:6], "rows 0 and 1 swapped": broken, "fault off": fixed})

# %%
new = [f for f in wb.vllm.findings[after_fault:] if f.at_least("warn")]
print(wb.vllm.summary_line())
assert new == [], [f.message for f in new]                   # the plugin is silent again
# bf16 on a CPU rounds differently for different batch shapes, so a greedy answer may differ in a word from
# the clean burst's (12 requests at a time, here 6) without anything being wrong: the plugin's silence is the check
print(f"{sum(a == b for a, b in zip(fixed, clean[:6]))} of 6 answers word for word as in the clean burst")

# %% [markdown]
# ## 5. Clean up
# Close the dashboard, stop vLLM (the server and its engine and worker processes), close the workbench's
# sockets, and remove the fault file and vLLM's log. On your own server you would only close the dashboard and
# the workbench.

# %%
dash.close()
server.stop()
wb.close()
shutil.rmtree(work, ignore_errors=True)
assert server.proc.poll() is not None                        # vLLM is gone
