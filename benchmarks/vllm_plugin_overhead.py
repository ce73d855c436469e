"""The vLLM plugin's cost: vLLM's own throughput with the plugin off and on, in one run.

A real vLLM CPU server (SmolLM2, bf16, 32-token blocks, prefix caching, KV events on in both
runs: they are vLLM's own cost, not ours) serves the same workload twice, once without
PAGEDKV_VLLM_SANITIZER (the plugin installed but off) and once with it on and a workbench
listening (every check each step: attention metadata, block pool, snapshot). Workload:
--requests chat requests sharing a system prompt, --concurrency at a time, --max-tokens
greedy tokens each, --rounds rounds per server (the best round counts; the first round
warms up). Printed: output tok/s for each, the ratio, and the plugin's own time per step
as it measured it (engine-core side). Target: <= 5% lost.

    .venv/bin/python benchmarks/vllm_plugin_overhead.py [--requests 32] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench import Workbench  # noqa: E402
from workbench.adapters.vllm.server import VllmServer, free_port  # noqa: E402

SYSTEM = "You are a concise assistant for an inference team. Answer in two sentences. " * 4


def workload(server, n, conc, max_tokens):
    qs = [f"Question {i}: explain item {i} of a paged KV cache briefly." for i in range(n)]

    def one(q):
        r = server.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], max_tokens=max_tokens,
                        ignore_eos=True)
        return r["usage"]["completion_tokens"]
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as ex:
        toks = sum(ex.map(one, qs))
    return toks / (time.perf_counter() - t)


def run(plugin: bool, a) -> tuple[float, dict]:
    kv = f"tcp://127.0.0.1:{free_port()}"
    san = f"tcp://127.0.0.1:{free_port()}" if plugin else None
    server = VllmServer(sanitizer=san, kv_events=kv, max_num_seqs=a.concurrency)
    wb = Workbench.connect_vllm(url=None, kv_events=kv, sanitizer=san)
    try:
        server.start()
        rates = [workload(server, a.requests, a.concurrency, a.max_tokens) for _ in range(a.rounds)]
        info = {"start_s": server.started_s, "rounds": rates}
        if plugin and wb.vllm.sanitizer.steps:
            steps = wb.vllm.sanitizer.steps
            info["check_ms"] = 1e3 * sum(s["check_s"] for s in steps) / len(steps)
            info["step_ms"] = 1e3 * sum(s["step_s"] for s in steps) / len(steps)
            info["findings"] = len(wb.vllm.findings)
            costs = list(wb.vllm.sanitizer.costs.values())
            if costs:
                n = sum(c["checks"] for c in costs)
                info["meta_ms"] = 1e3 * sum(c["check_s"] for c in costs) / max(1, n)
        return max(rates), info
    finally:
        server.stop()
        wb.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=2, help="servers started off, on, off, on, ...")
    a = ap.parse_args(argv)
    # off, on, off, on: the machine drifts over minutes; the best of each counts
    offs, ons = [], []
    for _ in range(a.pairs):
        offs.append(run(False, a))
        ons.append(run(True, a))
    (off, i_off), (on, i_on) = max(offs, key=lambda x: x[0]), max(ons, key=lambda x: x[0])
    i_off["rounds"] = [r for _, i in offs for r in i["rounds"]]
    i_on["rounds"] = [r for _, i in ons for r in i["rounds"]]
    print(f"vLLM {a.requests} requests x {a.max_tokens} tokens, {a.concurrency} at a time, best of {a.rounds} rounds "
          f"x {a.pairs} servers each:")
    print(f"  plugin off: {off:.1f} output tok/s  (rounds {', '.join(f'{r:.1f}' for r in i_off['rounds'])})")
    print(f"  plugin on : {on:.1f} output tok/s  (rounds {', '.join(f'{r:.1f}' for r in i_on['rounds'])}); "
          f"{i_on.get('findings', 0)} findings")
    print(f"  on / off = {on / off:.3f} ({(1 - on / off):+.1%} lost; target <= 5%)")
    if "check_ms" in i_on:
        print(f"  the plugin's engine-core checks: {i_on['check_ms']:.2f} ms per step of {i_on['step_ms']:.1f} ms "
              f"({i_on['check_ms'] / i_on['step_ms']:.1%})")
    if "meta_ms" in i_on:
        print(f"  the plugin's worker-side metadata check: {i_on['meta_ms']:.2f} ms per step "
              f"({i_on['meta_ms'] / i_on['step_ms']:.1%})")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
