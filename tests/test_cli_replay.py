"""`kvwb replay` from the command line: summary, report, trace; exit 2 only on error."""
import json
import subprocess
import sys
from pathlib import Path

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"


def kvwb(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "workbench.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_replay_simulate_writes_report_and_trace(tmp_path):
    # the real Azure trace where ../shared is checked out beside the repo, else the bundled excerpt
    from workbench.data import mooncake_excerpt
    src, head, pages = ((AZURE, "8819 requests (azure)", 4096) if AZURE.exists()
                        else (mooncake_excerpt(), "400 requests (mooncake)", 65536))
    r = kvwb("replay", src, "--limit", 300, "--num-pages", pages, "--report", tmp_path / "r.html",
             "--chrome-trace", tmp_path / "c.json", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert head in r.stdout and "replayed 300 requests" in r.stdout
    assert (tmp_path / "r.html").stat().st_size > 100_000
    events = json.loads((tmp_path / "c.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "b" for e in events) == 300


def test_replay_full_on_a_tiny_model(tmp_path, tiny_llama_dir):
    t = tmp_path / "t.jsonl"
    t.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": i * 0.01, "output_len": 4,
                                     "prompt_token_ids": [3 + i, 4, 5, 6] * (i + 1)}) + "\n" for i in range(6)))
    r = kvwb("replay", t, "--mode", "full", "--model", tiny_llama_dir, "--num-pages", 64, "--length-scale", 1,
             "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "replayed 6 requests" in r.stdout and "findings: none" in r.stdout


def test_replay_bad_trace_names_file_and_line(tmp_path):
    t = tmp_path / "bad.jsonl"
    t.write_text('{"arrival_s": 0, "output_len": 3, "prompt_len": 5}\n{"arrival_s": 1, "output_len": -2, "prompt_len": 5}\n')
    r = kvwb("replay", t)
    assert r.returncode == 2 and f"{t}:2: field 'output_len' is negative" in r.stderr
    assert "Traceback" not in r.stderr
    r = kvwb("replay", tmp_path / "missing.jsonl")
    assert r.returncode == 2 and "no such file" in r.stderr
