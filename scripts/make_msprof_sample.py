"""Write the small msprof sample that tests/test_msprof.py reads (tests/data/msprof/).

One PROF_ folder as current CANN lays it out (mindstudio_profiler_output/, see probes/msprof.py):
hbm_<timestamp>.csv (4 memory units) and op_summary_<timestamp>.csv (12 kernel launches: a
16-token prefill of one layer, then two 2-sequence decode steps, on a paged KV cache). The
op_summary header is msprof's widest (probes.msprof.OP_SUMMARY_HEADER) and the values are
formatted as msprof's writer formats them: start times in us with 3 decimals and a trailing
tab, durations with 3, wait times as C++ std::to_string (6), the first row's wait "0", N/A
where msprof has no value. The op names and numbers are made up, and deterministic: running
this again gives the same bytes (tests/test_msprof.py checks that), so edit this script, not
the files.

    python scripts/make_msprof_sample.py [--out tests/data/msprof]
"""
import argparse
import csv
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from probes.msprof import HBM_COLUMNS, OP_SUMMARY_HEADER  # noqa: E402

PROF = "PROF_000001_20250101120000000_KVWBSAMPLEAAAAAA/mindstudio_profiler_output"
STAMP = "20250101120000"
T0_NS = 1735732800_000_000_000           # 2025-01-01 12:00:00 UTC, the first task's start
BF16 = "DT_BF16"
KV_CACHE = "64,128,3,64"                  # pages, page size, KV heads, head dim
MM = "aclnnMatmul_MatMulV3_MatMulV3"      # op names: made up, in the style of eager-mode profiles
FIA = "aclnnFusedInferAttentionScore_FusedInferAttentionScore_FusedInferAttentionScore"
# (op name, OP Type, Task Type, duration ns, block num, mix block num, inputs, input dtypes, outputs)
PREFILL = [
    (MM, "MatMulV3", "AI_CORE", 48250, 24, 0, "16,576;960,576", f"{BF16};{BF16}", "16,960"),
    ("ReshapeAndCacheNdKernel", "ReshapeAndCacheNdKernel", "AI_VECTOR_CORE", 6125, 16, 0,
     f"16,3,64;16,3,64;{KV_CACHE};{KV_CACHE};16", f"{BF16};{BF16};{BF16};{BF16};INT32", f"{KV_CACHE};{KV_CACHE}"),
    (FIA, "FusedInferAttentionScore", "MIX_AIC", 95500, 24, 48,
     f"1,16,576;{KV_CACHE};{KV_CACHE};1,2", f"{BF16};{BF16};{BF16};INT32", "1,16,576"),
    (MM, "MatMulV3", "AI_CORE", 21750, 24, 0, "16,576;576,576", f"{BF16};{BF16}", "16,576"),
]


def decode(mm1, rac, pa, mm2):
    return [
        (MM, "MatMulV3", "AI_CORE", mm1, 24, 0, "2,576;960,576", f"{BF16};{BF16}", "2,960"),
        ("ReshapeAndCacheNdKernel", "ReshapeAndCacheNdKernel", "AI_VECTOR_CORE", rac, 2, 0,
         f"2,3,64;2,3,64;{KV_CACHE};{KV_CACHE};2", f"{BF16};{BF16};{BF16};{BF16};INT32", f"{KV_CACHE};{KV_CACHE}"),
        ("PagedAttentionMaskNdKernel", "PagedAttentionMaskNdKernel", "MIX_AIC", pa, 20, 40,
         f"2,9,64;{KV_CACHE};{KV_CACHE};2,4;2", f"{BF16};{BF16};{BF16};INT32;INT32", "2,9,64"),
        (MM, "MatMulV3", "AI_CORE", mm2, 24, 0, "2,576;576,576", f"{BF16};{BF16}", "2,576"),
    ]


KERNELS = PREFILL + decode(12500, 3250, 18000, 8750) + decode(12750, 3500, 19500, 9000)


def _us(ns: int) -> str:
    return f"{ns // 1000}.{ns % 1000:03d}"


def _pmu(dur_ns: int, task_type: str, last: bool) -> list[str]:
    """25 PMU values (aic_* then aiv_* then cube_utilization); made up, shaped like msprof's."""
    if last:                               # msprof fills N/A where no PMU record matched the task
        return ["N/A"] * 25
    us = dur_ns / 1000
    aic = us * 0.9 if task_type in ("AI_CORE", "MIX_AIC") else 0.0
    aiv = us * 0.85 if task_type in ("AI_VECTOR_CORE", "MIX_AIC") else 0.0
    cube = 0.0 if aic == 0 else 100 * 0.55 * aic / us

    def part(t, shares):
        return [f"{t:.3f}", str(int(t * 1800))] + [v for s in shares for v in (f"{t * s:.3f}", f"{s if t else 0:.3f}")]
    return (part(aic, (0.55, 0.08, 0.12, 0.30, 0.10)) + ["0.006"]
            + part(aiv, (0.40, 0.10, 0.35, 0.15)) + ["0.004", f"{cube:.3f}"])


def op_summary() -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(OP_SUMMARY_HEADER)
    start, prev = T0_NS, None
    for i, (name, op_type, task_type, dur, blocks, mix, ins, in_dt, outs) in enumerate(KERNELS):
        if i:                              # 2.5 us between launches, 150 us between steps
            start = prev[0] + prev[1] + (150_000 if i % 4 == 0 else 2_500)
        wait = "0" if prev is None else f"{max(0, start - prev[0] - prev[1]) / 1000:.6f}"
        mixed = task_type.startswith("MIX")
        w.writerow(["0", "4294967295", str(100 + i), "2", name,
                    op_type, "dynamic", task_type, _us(start) + "\t", _us(dur), wait, str(blocks),
                    str(mix), "NO", ins, in_dt, ";".join(["ND"] * len(ins.split(";"))), outs,
                    ";".join([BF16] * len(outs.split(";"))), ";".join(["ND"] * len(outs.split(";"))),
                    "0" if mixed else "N/A"] + _pmu(dur, task_type, i == len(KERNELS) - 1))
        prev = (start, dur)
    return buf.getvalue().encode()


def hbm() -> bytes:
    rows = [HBM_COLUMNS, ("0", "0", "183250.125", "41720.500"), ("0", "1", "179004.250", "40998.750"),
            ("0", "2", "181377.000", "41215.250"), ("0", "3", "176912.375", "N/A")]
    return "".join(",".join(r) + "\n" for r in rows).encode()


def sample_files() -> dict[str, bytes]:
    return {f"{PROF}/op_summary_{STAMP}.csv": op_summary(), f"{PROF}/hbm_{STAMP}.csv": hbm()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "msprof")
    a = ap.parse_args(argv)
    for rel, data in sample_files().items():
        path = a.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
