"""The workbench on a running vLLM (or vllm-ascend): the plugin inside it, the clients outside.

Inside vLLM (its own environment; numpy, torch and ZMQ only):
  plugin.py     the `vllm.general_plugins` entry point; off unless PAGEDKV_VLLM_SANITIZER is set
  settings.py   its environment settings, read without ever raising
  hooks.py      the wraps, on what every step path and runner shares (patching.py: class families)
  engine_side.py  the block pool against the ledger (Scheduler.schedule / update_from_output)
  worker_side.py  the attention metadata against the ledger (AttentionMetadataBuilder.build)
  ledger.py     our own request -> blocks record, from the SchedulerOutputs alone
  status.py, reporter.py  what runs (a log line per check), where findings go (socket and log)
  sanitizer.py  the checks, on probes/invariants.py (the same code as our own probes)
  faults.py     faults planted in vLLM's code paths, switched by a file (tests, notebooks)
  stream.py     what the plugin sends (ZMQ PUB -> the workbench's SUB on 127.0.0.1)

In the workbench:
  listener.py   the sanitizer stream's receiving end
  kv_events.py  vLLM's KV cache events (BlockStored / BlockRemoved / AllBlocksCleared), with replay
  metrics.py    vLLM's Prometheus /metrics
  connection.py VllmConnection: the three together (Workbench.connect_vllm)
  watch.py      `kvwb watch`: the same in a terminal, and its HTML report
  server.py     VllmServer: start a real vLLM with all of it on (tests, notebook, benchmark)
  model_dir.py  the default model as a safetensors directory vLLM loads
  prometheus.py kvwb_vllm_check_active{check} and the plugin's findings, for a scrape
  inproc.py     vLLM's real EngineCore in one process (tests: the batch-queue path; the benchmark)
  hwcheck.py    scripts/check_vllm_cuda.py / check_vllm_ascend.py: the plugin on hardware
"""
