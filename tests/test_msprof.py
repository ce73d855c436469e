"""msprof readers (probes/msprof.py) on the sample scripts/make_msprof_sample.py writes."""
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from probes.bandwidth import BandwidthProbe, read_msprof_hbm
from probes.msprof import OP_SUMMARY_HEADER, kernel_durations, read_msprof_op_summary

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "tests" / "data" / "msprof"
OUT = "PROF_000001_20250101120000000_KVWBSAMPLEAAAAAA/mindstudio_profiler_output"
OPS = SAMPLE / OUT / "op_summary_20250101120000.csv"
HEAD = "Op Name,OP Type,Task Type,Task Duration(us)\n"


def test_the_script_regenerates_the_sample_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_msprof_sample.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    made = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    kept = {p.relative_to(SAMPLE): p.read_bytes() for p in SAMPLE.rglob("*") if p.is_file()}
    assert made == kept, "tests/data/msprof is stale: run python scripts/make_msprof_sample.py"


def test_sample_header_is_msprofs():
    assert OPS.read_text().splitlines()[0].split(",") == list(OP_SUMMARY_HEADER)
    assert "\t," in OPS.read_text()                 # msprof's tab after each start time


def test_op_summary_typed_columns():
    df = read_msprof_op_summary(OPS)
    assert len(df) == 12 and list(df["line"]) == list(range(2, 14))
    assert df["duration_us"].dtype == float and df["duration_us"].iloc[0] == 48.25
    assert str(df["task_id"].dtype) == "Int64" and df["task_id"].iloc[-1] == 111
    assert df["op_type"].iloc[6] == "PagedAttentionMaskNdKernel" and df["task_type"].iloc[6] == "MIX_AIC"
    assert df["start_us"].iloc[0] == 1735732800000000.0        # the trailing tab is stripped
    assert df["wait_us"].iloc[0] == 0 and df["wait_us"].iloc[4] == 150.0
    assert df["input_shapes"].iloc[0] == "16,576;960,576"      # a quoted field with commas
    assert math.isnan(df["aicore_time_us"].iloc[-1])           # N/A -> NaN
    assert df["block_num"].iloc[6] == 20 and df["mix_block_num"].iloc[6] == 40


def test_kernel_summary_matches_a_hand_computation():
    k = kernel_durations(read_msprof_op_summary(SAMPLE)).set_index("op_type")
    # durations in the sample: MatMulV3 48.25 21.75 12.5 8.75 12.75 9.0; FIA 95.5; PA 18.0 19.5; RAC 6.125 3.25 3.5
    total = 113.0 + 95.5 + 37.5 + 12.875
    assert list(k.index) == ["MatMulV3", "FusedInferAttentionScore", "PagedAttentionMaskNdKernel",
                             "ReshapeAndCacheNdKernel"]
    mm = k.loc["MatMulV3"]
    assert (mm.calls, mm.total_us, mm.max_us) == (6, 113.0, 48.25)
    assert mm.mean_us == pytest.approx(113.0 / 6)
    assert mm.p50_us == pytest.approx((12.5 + 12.75) / 2)               # sorted: 8.75 9 12.5 12.75 21.75 48.25
    assert mm.p99_us == pytest.approx(21.75 + 0.95 * (48.25 - 21.75))   # position 0.99 * 5 = 4.95
    pa = k.loc["PagedAttentionMaskNdKernel"]
    assert (pa.calls, pa.total_us, pa.p50_us) == (2, 37.5, 18.75)
    assert pa.p99_us == pytest.approx(18.0 + 0.99 * 1.5)
    assert k["share"].sum() == pytest.approx(1.0)
    assert k.loc["ReshapeAndCacheNdKernel", "share"] == pytest.approx(12.875 / total)
    assert list(k["paged_kv"]) == [False, True, True, True]
    assert k.loc["ReshapeAndCacheNdKernel", "task_type"] == "AI_VECTOR_CORE"


def test_hbm_sample():
    df = read_msprof_hbm(SAMPLE)
    assert list(df["metric"]) == ["0", "1", "2", "3"] and df["read_mbs"].iloc[0] == 183250.125
    assert math.isnan(df["write_mbs"].iloc[3])


def test_directory_discovery_both_layouts_and_no_double_count(tmp_path):
    old = tmp_path / "PROF_000002_X" / "device_0" / "summary"       # older CANN
    old.mkdir(parents=True)
    shutil.copy(OPS, old / "op_summary_0_1_1.csv")
    assert len(read_msprof_op_summary(tmp_path)) == 12
    shutil.copytree(SAMPLE / OUT, tmp_path / "PROF_000002_X" / "mindstudio_profiler_output")
    assert len(read_msprof_op_summary(tmp_path)) == 12              # the merged copy only
    shutil.copytree(SAMPLE / OUT, tmp_path / "PROF_000003_Y" / "mindstudio_profiler_output")
    assert len(read_msprof_op_summary(tmp_path)) == 24              # another run counts
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no op_summary_"):
        read_msprof_op_summary(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        read_msprof_op_summary(tmp_path / "nothing_here")


def test_bad_input_names_file_line_and_column(tmp_path):
    bad = tmp_path / "op_summary_bad.csv"
    bad.write_text("Op Name,OP Type,Task Type\nx,MatMulV3,AI_CORE\n")
    with pytest.raises(ValueError, match=r"op_summary_bad\.csv:1: .*lacks \['Task Duration\(us\)'\]"):
        read_msprof_op_summary(bad)
    bad.write_text(HEAD + "x,MatMulV3,AI_CORE,1.5\n\nx,MatMulV3,AI_CORE,fast\n")
    with pytest.raises(ValueError, match=r"op_summary_bad\.csv:4: Task Duration\(us\) is 'fast', not a number"):
        read_msprof_op_summary(bad)
    bad.write_text(HEAD + "x,MatMulV3,AI_CORE,-2\n")
    with pytest.raises(ValueError, match=r"op_summary_bad\.csv:2: Task Duration\(us\) is '-2': a duration"):
        read_msprof_op_summary(bad)
    bad.write_text("Task ID," + HEAD + "7.5,x,MatMulV3,AI_CORE,1\n")
    with pytest.raises(ValueError, match=r"op_summary_bad\.csv:2: Task ID is '7\.5', not an integer"):
        read_msprof_op_summary(bad)
    bad.write_text(HEAD + "x,MatMulV3,AI_CORE\n")
    with pytest.raises(ValueError, match=r"op_summary_bad\.csv:2: 3 fields, the header has 4"):
        read_msprof_op_summary(bad)
    bad.write_text(HEAD + ",MatMulV3,AI_CORE,1\n")
    with pytest.raises(ValueError, match=r"op_summary_bad\.csv:2: Op Name is empty"):
        read_msprof_op_summary(bad)
    bad.write_text("")
    with pytest.raises(ValueError, match=r"op_summary_bad\.csv:1: empty file"):
        read_msprof_op_summary(bad)


def test_na_duration_and_missing_op_type(tmp_path):
    f = tmp_path / "op_summary_1.csv"
    f.write_text(HEAD + "hcom_allReduce_1,N/A,COMMUNICATION,10\nx,MatMulV3,AI_CORE,N/A\nx,MatMulV3,AI_CORE,4\n")
    df = read_msprof_op_summary(f)
    assert pd.isna(df["op_type"].iloc[0]) and math.isnan(df["duration_us"].iloc[1])
    assert df["task_id"].isna().all()                             # a column the file lacks
    k = kernel_durations(df).set_index("op_type")
    assert k.loc["hcom_allReduce_1", "calls"] == 1                 # counted under its Op Name
    assert (k.loc["MatMulV3", "calls"], k.loc["MatMulV3", "total_us"]) == (2, 4.0)
    assert k.loc["MatMulV3", "share"] == pytest.approx(4 / 14)


def test_bandwidth_probe_reads_its_msprof_dir():
    p = BandwidthProbe(msprof_dir=str(SAMPLE), peak_gbs=1000.0)
    assert p.kernels()["op_type"].iloc[0] == "MatMulV3"
    assert p.hbm()["share_of_peak"].iloc[0] == pytest.approx(0.224970625)
    with pytest.raises(ValueError, match="msprof_dir"):
        BandwidthProbe().kernels()
