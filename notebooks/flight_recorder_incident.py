# %% [markdown]
# # A 3 a.m. incident, from the flight recorder
#
# The vLLM plugin keeps a **flight recorder** whenever it is on: every request (arrival, prompt, sampling), the
# block pool step by step (blocks allocated, shared on a prefix hit, freed), each step's schedule, and the
# plugin's findings, in a bounded ring of JSONL segments on disk (`PAGEDKV_RECORD_DIR`, 256 MB by default; the
# oldest segment goes first). A finding of severity `error` **freezes a repro bundle**: the ring's window at that
# moment, copied aside. So does `kvwb dump DIR`, SIGUSR1, or SIGTERM. A killed process still leaves a recording
# that opens.
#
# This notebook walks one incident end to end:
#
# 1. vLLM (its real EngineCore, CPU build, in-process) serves a workload with a bug planted in vLLM's sliding-window
#    code: the window's trailing edge is computed one block too far, so a block the kernel still reads is freed and
#    handed to another request;
# 2. the plugin's finding freezes a bundle; we open it as the on-call engineer would, with nothing else;
# 3. we scrub the recorded pool to the step before the finding and look at the requests involved;
# 4. we replay the bundle's requests, through our simulator with the recorded settings and back through vLLM,
#    and see the same fault found again.
#
# The model is a tiny random-weight hybrid written here (layer 0 sliding-window attention of 64 tokens, layer 1
# full attention): vLLM gives it two KV cache groups in one block pool, as it does for Gemma-3 or Mistral models.

# %%
import tempfile
from pathlib import Path

import pandas as pd
from workbench import Workbench
from workbench.adapters.vllm.driver import fault_file, run_inproc, run_python

pd.set_option("display.max_colwidth", 160)
work = Path(tempfile.mkdtemp(prefix="incident-"))
model = work / "hybrid-model"
# written by transformers in vLLM's environment (run_python: as `python -c` there, in a forked process)
written = run_python("import sys\nfrom workbench.adapters.vllm.tiny_model import write_tiny_model_dir\n"
                     "write_tiny_model_dir(sys.argv[1], hybrid=True)", str(model))
assert written.returncode == 0, written.stderr[-2000:]
print("model:", model)

# %% [markdown]
# ## 1. The incident
# Six requests share a 70-token system prompt (prefix-cache hits) and generate 40 tokens each; one arrives every
# 4 steps. The fault file plants `window_frees_one_block_early` through the plugin's seam in
# `SlidingWindowManager.get_num_skipped_tokens`. The recorder writes under `work/recordings`.

# %%
faults = fault_file(work, "window_frees_one_block_early")
WORKLOAD = ("--model", str(model), "--requests", "6", "--max-tokens", "40", "--num-blocks", "80", "--stagger", "4")
incident = run_inproc(*WORKLOAD, env={"PAGEDKV_RECORD_DIR": str(work / "recordings"),
                                      "PAGEDKV_VLLM_FAULT_FILE": faults})
print([line.split("] ", 1)[-1] for line in incident.log.splitlines() if "flight recorder" in line or "bundle" in line])

# %% [markdown]
# The log names the recording and the bundle the first `error` froze. That path is all the on-call engineer
# needs.

# %%
recording = next((work / "recordings").iterdir())
bundle = sorted((recording / "bundles").iterdir())[0]
print(bundle)

# %% [markdown]
# ## 2. Open the bundle
# `Workbench.open` reads a bundle or a recorder directory (even one a killed process left: a torn last line is
# skipped and counted, a damaged one named by file and line). The header says what ran: vLLM's version, the block
# size, the pool, the KV cache groups, the batching limits.

# %%
rec = Workbench.open(bundle)
print({k: rec.header[k] for k in ("writer", "vllm", "block_size", "num_blocks", "kv_cache_groups",
                                  "max_num_seqs", "max_num_batched_tokens")})
rec.findings_frame()[["step", "severity", "kind", "request_id", "page", "message"]].head()

# %% [markdown]
# The first finding: a block still inside a request's sliding window has `ref_cnt` 0. vLLM freed it while the
# kernel still reads it; its next owner overwrites the K/V. The requests in the bundle:

# %%
first = min(rec.findings, key=lambda f: f["step"])
rec.frame("requests")[["id", "step", "arrival_s", "output_len"]]

# %% [markdown]
# ## 3. The step before the finding
# The recorded pool, rebuilt by time travel at any recorded step. The dashboard is scrubbable (drag the slider);
# here it opens at the step before the finding. Then the blocks of the request the finding names, and who else
# held them.

# %%
dash = rec.dashboard()
dash.show_step(max(1, first["step"] - 1))
dash

# %%
tt = rec.time_travel()
before = tt.state_at(max(1, first["step"] - 1)).frame()
names = rec.names                                             # vLLM's request ids, numbered for the map
who = {v: k for k, v in names.items()}[first["request_id"]]
print(f"step {first['step'] - 1}: request {first['request_id']} holds",
      before[before.owner == who].page.tolist(), "; block", first["page"], "is",
      before.loc[before.page == first["page"], "state"].item())

# %% [markdown]
# ## 4. Replay
# **Through our simulator**, with the recorded block size, pool size and batching limits (`kvwb replay BUNDLE` does
# the same from a shell):

# %%
sim = rec.replay()
print(f"{len(sim.requests)} requests replayed in {len(sim.steps)} steps, page size {sim.engine.config.page_size}, "
      f"{sim.engine.config.num_pages} pages")

# %% [markdown]
# **Back through vLLM**, each request added before the step it was first scheduled at in the recording. With the
# bug still planted, the same finding comes back on the same request; without it, nothing. That is the
# regression test for the fix.

# %%
again = run_inproc("--model", str(model), "--trace", str(bundle), "--num-blocks", "80",
                   env={"PAGEDKV_RECORD": "0", "PAGEDKV_VLLM_FAULT_FILE": faults})
fixed = run_inproc("--model", str(model), "--trace", str(bundle), "--num-blocks", "80", env={"PAGEDKV_RECORD": "0"})
same = [f for f in again.at_least("error") if f.kind == first["kind"] and f.request_id == first["request_id"]]
print(f"with the bug: {len(again.at_least('error'))} errors, the first finding's kind on {first['request_id']}: "
      f"{'found again' if same else 'NOT found'}")
print(f"without it: {len(fixed.at_least('warn'))} findings >= warn")
assert same and not fixed.at_least("warn")
