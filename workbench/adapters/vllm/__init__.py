"""The workbench on a running vLLM (or vllm-ascend): the plugin inside it, the clients outside.

Inside vLLM (its own environment; numpy, torch and ZMQ only):
  plugin.py     the `vllm.general_plugins` entry point; off unless PAGEDKV_VLLM_SANITIZER is set
  hooks.py      the wraps (EngineCore.step, GPUModelRunner.execute_model, AttentionGroup.build_metadata)
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
"""
