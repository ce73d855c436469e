"""msprof's CSV summaries (CANN's profiler on Ascend), read into pandas.

msprof writes a PROF_<n>_<time>_<id>/ folder per run; current CANN puts the summaries of every
device in mindstudio_profiler_output/<name>_<timestamp>.csv, older CANN in
device_<id>/summary/<name>_*.csv [1]. Both layouts are searched; where a PROF_ folder has both,
only mindstudio_profiler_output/ is read, so no kernel is counted twice.

hbm_*.csv [2]: Device_id, Metric (the ID of the memory access unit), Read(MB/s), Write(MB/s).

op_summary_*.csv [3]: one row per task (kernel launch) on the device. Its columns vary with the
chip and msprof's --task-time / --aic-metrics options [3], so only Op Name, OP Type and
Task Duration(us) are required. OP_SUMMARY_HEADER is the widest header msprof writes today (a
Stars chip, tasks + HCCL + PMU), copied from msprof's own test [4]; msprof's source names
"Block Num" / "Mix Block Num" what the CANN 7 docs call "Block Dim" / "Mix Block Dim" [3]: both
are read. msprof writes N/A where it has no value (ids of HCCL tasks, unmatched PMU data) and
appends a tab to Task Start Time(us) so spreadsheets keep its digits [5]; both are handled.

OP Types of the paged-KV kernels (PAGED_KV_OP_TYPES): the docs give no list of them. From msprof's
test data and published op_summary profiles: PagedAttentionMaskNdKernel (ATB PagedAttention,
Task Type MIX_AIC) [6], ReshapeAndCacheNdKernel (ATB ReshapeAndCache), and the aclnn ops
FusedInferAttentionScore / IncreFlashAttention / PromptFlashAttention under their op names.

[1] https://www.hiascend.com/document/detail/en/canncommercial/850/devaids/profiling/atlasprofiling_16_0056.html
[2] https://www.hiascend.com/document/detail/en/canncommercial/850/devaids/profiling/atlasprofiling_16_0084.html
[3] https://www.hiascend.com/document/detail/en/canncommercial/850/devaids/profiling/atlasprofiling_16_0067.html
    (CANN 7: https://www.hiascend.com/document/detail/en/mindstudio/700/TITools/Profiling/atlasprofiling_16_0067.html)
[4] github.com/Ascend/msprof test/msprof_cpp/analysis_ut/application/assemble/test/op_summary_assembler_utest.cpp
    (ShouldReturnTrueWhenTaskAndHcclAndPmuExistWithStars)
[5] github.com/Ascend/msprof analysis/csrc/application/summary/op_summary_assembler.cpp
[6] github.com/Ascend/msprof test/msprof_cpp/analysis_ut/domain/data_process/test/op_statistic_processor_utest.cpp
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:                   # annotations only: pandas is imported where a frame is built
    import pandas as pd

import csv
import math
from pathlib import Path

HBM_COLUMNS = ("Device_id", "Metric", "Read(MB/s)", "Write(MB/s)")
OP_SUMMARY_REQUIRED = ("Op Name", "OP Type", "Task Duration(us)")
OP_SUMMARY_HEADER = tuple((
    "Device_id,Model ID,Task ID,Stream ID,Op Name,OP Type,OP State,Task Type,Task Start Time(us),"
    "Task Duration(us),Task Wait Time(us),Block Num,Mix Block Num,HF32 Eligible,Input Shapes,Input Data Types,"
    "Input Formats,Output Shapes,Output Data Types,Output Formats,Context ID,aicore_time(us),aic_total_cycles,"
    "aic_mac_time(us),aic_mac_ratio,aic_scalar_time(us),aic_scalar_ratio,aic_mte1_time(us),aic_mte1_ratio,"
    "aic_mte2_time(us),aic_mte2_ratio,aic_fixpipe_time(us),aic_fixpipe_ratio,aic_icache_miss_rate,aiv_time(us),"
    "aiv_total_cycles,aiv_vec_time(us),aiv_vec_ratio,aiv_scalar_time(us),aiv_scalar_ratio,aiv_mte2_time(us),"
    "aiv_mte2_ratio,aiv_mte3_time(us),aiv_mte3_ratio,aiv_icache_miss_rate,cube_utilization(%)").split(","))
PAGED_KV_OP_TYPES = ("PagedAttentionMaskNdKernel", "ReshapeAndCacheNdKernel", "FusedInferAttentionScore",
                     "IncreFlashAttention", "PromptFlashAttention")

# msprof column -> (frame column, kind). "us": microseconds, finite and >= 0; "float": any number.
_OP_COLUMNS = {
    "Device_id": ("device_id", "int"), "Model ID": ("model_id", "int"), "Task ID": ("task_id", "int"),
    "Stream ID": ("stream_id", "int"), "Op Name": ("op_name", "str"), "OP Type": ("op_type", "str"),
    "OP State": ("op_state", "str"), "Task Type": ("task_type", "str"),
    "Task Start Time(us)": ("start_us", "float"), "Task Duration(us)": ("duration_us", "us"),
    "Task Wait Time(us)": ("wait_us", "us"), "Block Num": ("block_num", "int"), "Block Dim": ("block_num", "int"),
    "Mix Block Num": ("mix_block_num", "int"), "Mix Block Dim": ("mix_block_num", "int"),
    "Input Shapes": ("input_shapes", "str"), "Input Data Types": ("input_dtypes", "str"),
    "Output Shapes": ("output_shapes", "str"), "Output Data Types": ("output_dtypes", "str"),
    "aicore_time(us)": ("aicore_time_us", "us"), "aiv_time(us)": ("aiv_time_us", "us"),
}
OP_SUMMARY_FRAME = ["file", "line"] + list(dict.fromkeys(c for c, _ in _OP_COLUMNS.values()))
_NA = ("N/A", "NA", "")


def _files(p: Path, pattern: str) -> list[Path]:
    if not p.is_dir():
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or folder")
        return [p]
    files = sorted(p.rglob(pattern))
    # mindstudio_profiler_output/ merges its PROF_ folder's device_*/summary/: read one, not both
    merged = {f.parent.parent for f in files if f.parent.name == "mindstudio_profiler_output"}
    files = [f for f in files if not (f.parent.name == "summary" and f.parent.parent.parent in merged)]
    if not files:
        raise FileNotFoundError(f"no {pattern} under {p} (msprof writes them to PROF_*/mindstudio_profiler_output/, "
                                f"older CANN to PROF_*/device_*/summary/)")
    return files


def _records(path: Path, required: tuple, what: str):
    """(line, {column: text}) per row; ValueError naming path:line for a header without `required`,
    a row whose width is not the header's, or a file with no header."""
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        header = None
        for fields in reader:
            if not fields or all(not f.strip() for f in fields):
                continue
            where = f"{path}:{reader.line_num}"
            if header is None:
                header = [f.strip() for f in fields]
                missing = [c for c in required if c not in header]
                if missing:
                    raise ValueError(f"{where}: header {header} lacks {missing}; msprof {what} has "
                                     f"{', '.join(required)}")
                continue
            if len(fields) != len(header):
                raise ValueError(f"{where}: {len(fields)} fields, the header has {len(header)}")
            yield reader.line_num, dict(zip(header, fields))
        if header is None:
            raise ValueError(f"{path}:1: empty file, expected the header {', '.join(required)}")


def _number(text: str, where: str, col: str, kind: str = "us"):
    t = text.strip()                            # msprof appends "\t" to start times
    if t.upper() in _NA:                        # msprof writes N/A where a unit reported nothing
        return None if kind == "int" else math.nan
    try:
        v = int(t) if kind == "int" else float(t)
    except ValueError:
        raise ValueError(f"{where}: {col} is {text!r}, not {'an integer' if kind == 'int' else 'a number'}") from None
    if kind in ("us", "rate") and (v < 0 or math.isinf(v)):
        noun = "a bandwidth" if kind == "rate" else "a duration"
        raise ValueError(f"{where}: {col} is {text!r}: {noun} is finite and >= 0")
    return v


# ---- hbm_*.csv -------------------------------------------------------------------------
def _read_hbm_file(path: Path) -> list[dict]:
    rows = []
    for line, rec in _records(path, HBM_COLUMNS, "hbm_*.csv"):
        where = f"{path}:{line}"
        dev = rec["Device_id"].strip()
        if not dev.isdigit():
            raise ValueError(f"{where}: Device_id is {dev!r}, not a device number")
        metric = rec["Metric"].strip()
        if not metric:
            raise ValueError(f"{where}: Metric is empty")
        rows.append({"file": str(path), "line": line, "device_id": int(dev), "metric": metric,
                     "read_mbs": _number(rec["Read(MB/s)"], where, "Read(MB/s)", "rate"),
                     "write_mbs": _number(rec["Write(MB/s)"], where, "Write(MB/s)", "rate")})
    return rows


def read_msprof_hbm(path_or_dir) -> "pd.DataFrame":
    """msprof's hbm_*.csv (a file, or every one under a directory) as a DataFrame:
    file, line, device_id, metric (the memory unit), read_mbs, write_mbs, total_gbs.

    A malformed row raises ValueError naming file:line and the column."""
    import pandas as pd
    rows = [r for f in _files(Path(path_or_dir), "hbm_*.csv") for r in _read_hbm_file(f)]
    df = pd.DataFrame(rows, columns=["file", "line", "device_id", "metric", "read_mbs", "write_mbs"])
    df["total_gbs"] = (df["read_mbs"] + df["write_mbs"]) / 1000.0
    return df


# ---- op_summary_*.csv ------------------------------------------------------------------
def _read_op_summary_file(path: Path) -> list[dict]:
    rows = []
    for line, rec in _records(path, OP_SUMMARY_REQUIRED, "op_summary_*.csv"):
        where = f"{path}:{line}"
        row = {"file": str(path), "line": line}
        for col, text in rec.items():
            if col not in _OP_COLUMNS:
                continue                        # PMU counters and the rest: read the CSV for them
            name, kind = _OP_COLUMNS[col]
            if kind == "str":
                t = text.strip()
                row[name] = None if t in _NA else t
            else:
                row[name] = _number(text, where, col, kind)
        if not row.get("op_name"):
            raise ValueError(f"{where}: Op Name is empty")
        rows.append(row)
    return rows


def read_msprof_op_summary(path_or_dir) -> "pd.DataFrame":
    """msprof's op_summary_*.csv (a file, or every one under a directory, as msprof lays them out)
    as a DataFrame, one row per task, columns OP_SUMMARY_FRAME: file, line, device_id, model_id,
    task_id, stream_id (Int64, <NA> where msprof wrote N/A), op_name, op_type, op_state, task_type
    (str, missing for N/A), start_us (float64: 0.25 us steps at today's epoch), duration_us,
    wait_us (float us, NaN for N/A), block_num, mix_block_num, input_shapes, input_dtypes,
    output_shapes, output_dtypes, aicore_time_us, aiv_time_us; a column the file lacks is all
    missing. A missing required column, or a value that is not a number (a negative
    duration), raises ValueError naming file:line and the column."""
    import pandas as pd
    rows = [r for f in _files(Path(path_or_dir), "op_summary_*.csv") for r in _read_op_summary_file(f)]
    df = pd.DataFrame(rows, columns=OP_SUMMARY_FRAME)
    for col, kind in dict(_OP_COLUMNS.values()).items():
        df[col] = df[col].astype("Int64" if kind == "int" else float if kind in ("us", "float") else object)
    return df


def kernel_durations(df, by: str = "op_type") -> "pd.DataFrame":
    """Per OP Type (or `by`): calls, total_us, mean_us, p50_us, p99_us, max_us, share (of the summed
    duration of every row), task_type (the most common), paged_kv (an OP Type in PAGED_KV_OP_TYPES);
    largest total first. A row with no OP Type counts under its Op Name; a duration msprof left N/A
    counts as a call but not in the sums and quantiles (linear, as pandas' quantile)."""
    import pandas as pd
    key = df[by].astype(object)
    if by == "op_type":
        key = key.where(key.notna() & (key != ""), df["op_name"])
    g = df.assign(_k=key.values).groupby("_k", sort=False)
    dur = g["duration_us"]
    out = pd.DataFrame({"calls": g.size(), "total_us": dur.sum(), "mean_us": dur.mean(),
                        "p50_us": dur.quantile(0.5), "p99_us": dur.quantile(0.99), "max_us": dur.max(),
                        "task_type": g["task_type"].agg(lambda s: s.mode().iat[0] if s.notna().any() else None)})
    total = df["duration_us"].sum()
    out.insert(6, "share", out["total_us"] / total if total > 0 else math.nan)
    out["paged_kv"] = [k in PAGED_KV_OP_TYPES for k in out.index]
    out = out.rename_axis(by).reset_index()
    return out.sort_values(["total_us", by], ascending=[False, True], ignore_index=True)
