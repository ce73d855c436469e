"""Chrome trace and HTML report of a replay: required fields, parseable, self-contained."""
import json
import re
from pathlib import Path

import pytest

from workbench import Engine, EngineConfig, Workbench
from workbench.export import merge_into, to_chrome_trace, write_chrome_trace, write_html_report
from workbench.trace import read_trace, replay

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"
REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "C": {"name", "ph", "ts", "pid", "args"},
            "b": {"name", "ph", "ts", "pid", "id", "cat"}, "e": {"name", "ph", "ts", "pid", "id", "cat"},
            "M": {"name", "ph", "pid", "args"}}


@pytest.fixture(scope="module")
def result(tiny_llama_dir):
    eng = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_pages=40, max_num_seqs=8))
    wb = Workbench(eng)
    # the real Azure trace where ../shared is checked out beside the repo, else the bundled excerpt
    from workbench.data import mooncake_excerpt
    src, scale = (AZURE, 1 / 32) if AZURE.exists() else (mooncake_excerpt(), 1 / 256)   # Mooncake's are long
    return replay(read_trace(src)[:16], wb, "full", length_scale=scale, max_output_len=6, progress=False)


def test_chrome_trace_fields_and_parse(result, tmp_path):
    path = write_chrome_trace(result.log, tmp_path / "t.json")
    trace = json.loads(path.read_text())
    kinds = {}
    for e in trace["traceEvents"]:
        missing = REQUIRED[e["ph"]] - set(e)
        assert not missing, (e, missing)
        kinds[e["ph"]] = kinds.get(e["ph"], 0) + 1
    assert kinds["X"] == len(result.steps)
    assert kinds["b"] == kinds["e"] == 16
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"PagedKV Workbench engine", "engine steps", "requests"} <= names
    # each request's end comes after its begin; steps do not overlap
    begins = {e["id"]: e["ts"] for e in trace["traceEvents"] if e["ph"] == "b"}
    assert all(e["ts"] >= begins[e["id"]] for e in trace["traceEvents"] if e["ph"] == "e")
    xs = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X")
    assert all(a[1] <= b[0] + 1e-3 for a, b in zip(xs, xs[1:]))


def test_chrome_trace_merges_into_a_torch_profiler_trace(result, tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    theirs = tmp_path / "prof.json"
    prof.export_chrome_trace(str(theirs))
    merged = merge_into(to_chrome_trace(result.log), theirs)
    n_theirs = len(json.loads(theirs.read_text())["traceEvents"])
    assert len(merged["traceEvents"]) == n_theirs + len(to_chrome_trace(result.log)["traceEvents"])
    json.dumps(merged)


def test_html_report_is_self_contained(result, tmp_path):
    path = write_html_report(result, tmp_path / "r.html")
    text = path.read_text()
    assert "Pool timeline" in text and "Plotly.newPlot" in text
    # no tag loads a resource from elsewhere (plotly's bundled JS mentions URLs, but loads none)
    assert not re.search(r"""<(script|link|img|iframe)[^>]*(src|href)\s*=\s*["']?(https?:)?//""", text, re.I)
    assert "cdn.plot.ly" not in re.sub(r"<script[^>]*>.*?</script>", "", text, flags=re.S)
    assert "No findings." in text
