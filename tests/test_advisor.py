"""Pool advisor over a real trace: the trade-offs come out the way paging says they must."""
import math
from pathlib import Path

import numpy as np
import pytest

from workbench.trace import read_trace
from workbench.trace.advisor import advise, recommend, rule_of_thumb_pages
from workbench.trace.synth import scaled_length

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv"
pytestmark = pytest.mark.skipif(not AZURE.exists(), reason="../shared/traces not present")


def test_rule_of_thumb_matches_the_seed_formula():
    lengths = list(range(1, 1001))
    p99 = np.percentile(lengths, 99)
    assert rule_of_thumb_pages(lengths, 8, 16) == math.ceil(math.ceil(8 * p99 / 16) * 1.3)


def test_advisor_sweep_and_recommendation():
    t = read_trace(AZURE)
    table = advise(t, page_sizes=(16, 64), limit=300, max_batch=32, length_scale=1 / 8, time_scale=0.05,
                   progress=False)
    assert {"page_size", "num_pages", "peak_usage", "internal_waste", "block_table_bytes", "preemptions",
            "rejections", "prefix_hit_rate", "recommended"} <= set(table.columns)
    for ps, g in table.groupby("page_size"):
        g = g.sort_values("num_pages")
        assert g["preemptions"].is_monotonic_decreasing or g["preemptions"].iloc[0] >= g["preemptions"].iloc[-1]
        assert g["peak_usage"].iloc[0] >= g["peak_usage"].iloc[-1]
        rule = g[g["recommended"]].iloc[0]
        lengths = [scaled_length(r.prompt_len, 1 / 8) + max(1, scaled_length(r.output_len, 1 / 8)) for r in t[:300]]
        assert rule["num_pages"] == max(rule_of_thumb_pages(lengths, 32, ps), math.ceil(max(lengths) / ps) + 1)
    waste = table.groupby("page_size")["internal_waste"].mean()
    assert waste[64] > waste[16]                       # bigger pages, more slack in last pages
    bt = table.groupby("page_size")["block_table_bytes"].first()
    assert bt[64] < bt[16] <= bt[64] * 4               # and smaller page tables (ceil per row)
    rec = recommend(table)
    row = table[(table.page_size == rec["page_size"]) & (table.num_pages == rec["num_pages"])].iloc[0]
    assert row["preemptions"] == 0 and row["rejections"] == 0


def test_parallel_sweep_equals_the_serial_one(monkeypatch):
    import concurrent.futures

    import pandas as pd
    t = read_trace(AZURE)
    kw = dict(page_sizes=(16, 64), limit=150, max_batch=16, length_scale=1 / 8, time_scale=0.05)
    serial = advise(t, workers=1, progress=False, **kw)
    parallel = advise(t, workers=2, progress=True, **kw)          # spawned processes, a progress bar
    pd.testing.assert_frame_equal(serial, parallel)

    def no_processes(*a, **k):
        raise OSError("no processes here")
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", no_processes)
    pd.testing.assert_frame_equal(serial, advise(t, workers=2, progress=False, **kw))   # falls back to serial
