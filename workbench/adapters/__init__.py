"""Adapters: the workbench's probes and views on engines other than its own (vLLM)."""
