"""The tests' name for workbench/adapters/vllm/driver.py (vLLM's EngineCore in a subprocess, listened to)."""
from workbench.adapters.vllm.driver import Run, fault_file, plugin_lines, run_inproc  # noqa: F401
