"""Page map and dashboard speed (a benchmark, not a test).

1. Page-map updates per second at 131,072 pages, Python side: encode one byte a page and
   send it (ipywidgets state + binary buffer, serialised as the kernel would), and the
   bytes each update sends.
2. The whole live path at that size: PoolState.from_engine on a 131,072-page pool that
   a simulated workload keeps busy, then encode and send.
3. The browser side, when Chromium is there: page_map.js draws per second at that size.
4. The dashboard's cost on engine throughput while live: the same workload with the
   event log and probes, then with the dashboard following it too (alternating runs;
   the widgets' messages are serialised as a kernel would, then dropped).

    .venv/bin/python benchmarks/page_map_speed.py [--pages 131072] [--model tiny|smollm2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid

import numpy as np


class SerialisingComm:
    """What ipykernel's comm does with a widget message, short of the socket: JSON + buffers."""
    sent_bytes = 0
    messages = 0

    def __init__(self, **_kw):
        self.comm_id = uuid.uuid4().hex
        self.kernel = object()

    def send(self, data=None, buffers=None, **_kw):
        n = len(json.dumps(data, default=str)) + sum(len(memoryview(b).cast("B")) for b in (buffers or []))
        SerialisingComm.sent_bytes += n
        SerialisingComm.messages += 1

    def on_msg(self, _fn):
        pass

    def open(self, *a, **kw):
        pass

    def close(self, *a, **kw):
        pass


def install_comm() -> None:
    import comm
    comm.create_comm = SerialisingComm


def random_states(n: int, k: int = 8, seed: int = 0):
    from workbench.trace.timetravel import PoolState
    rng = np.random.default_rng(seed)
    out = []
    for i in range(k):
        st = PoolState.empty(n, i)
        st.ref[:] = rng.choice([0, 0, 1, 1, 1, 2], n)
        st.owner[:] = np.where(st.ref > 0, rng.integers(0, 4000, n), -1)
        st.cached[:] = (st.ref == 0) & (rng.random(n) < 0.3)
        out.append(st)
    return out


def bench_serialise(n: int, seconds: float = 3.0) -> None:
    from workbench.widgets import PageMap
    pm = PageMap(n)
    states = random_states(n)
    SerialisingComm.sent_bytes = SerialisingComm.messages = 0
    t0, i = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        pm.show(states[i % len(states)])
        i += 1
    dt = time.perf_counter() - t0
    print(f"[1] page map, {n:,} pages: {i / dt:8.1f} updates/s serialised in Python "
          f"({dt / i * 1e3:.2f} ms each), {SerialisingComm.sent_bytes / i:,.0f} bytes per update "
          f"({pm.cols} x {-(-n // pm.cols)} cells of {pm.cell} px)")


def bench_live_path(n: int, updates: int = 30) -> None:
    from workbench.engine import EngineConfig
    from workbench.trace.simulate import Simulator
    from workbench.trace.timetravel import PoolState
    from workbench.widgets import PageMap
    sim = Simulator(EngineConfig(num_pages=n, max_num_seqs=256, max_num_batched_tokens=16384))
    rng = np.random.default_rng(1)
    for i in range(400):                     # a shared 2-block system prompt, then each its own blocks
        plen = int(rng.integers(200, 4000))
        ids = [1, 2] + [100_000 * (i + 1) + j for j in range(-(-plen // 64) - 2)]
        sim.add_request(plen, int(rng.integers(50, 400)), hash_ids=ids, hash_block_size=64)
    for _ in range(40):
        sim.step()
    from workbench.widgets.dashboard import live_state
    pm = PageMap(n)
    slow, snap, send = [], [], []
    for _ in range(updates):
        sim.step()
        t0 = time.perf_counter()
        PoolState.from_engine(sim)
        t1 = time.perf_counter()
        st = live_state(sim)
        t2 = time.perf_counter()
        pm.show(st)
        t3 = time.perf_counter()
        slow.append(t1 - t0)
        snap.append(t2 - t1)
        send.append(t3 - t2)
    c = pm.state.counts()
    med = {k: statistics.median(v) * 1e3 for k, v in (("slow", slow), ("snap", snap), ("send", send))}
    print(f"[2] live path, {n:,} pages ({c['owned'] + c['shared']:,} in use): snapshot {med['snap']:.1f} ms "
          f"(live_state; PoolState.from_engine takes {med['slow']:.1f} ms) + encode/send {med['send']:.1f} ms "
          f"= {1e3 / (med['snap'] + med['send']):.1f} updates/s")


def bench_browser(n: int, draws: int = 40) -> None:
    chromium = "/usr/bin/chromium"
    if not os.path.exists(chromium):
        print("[3] browser draw: skipped (no /usr/bin/chromium)")
        return
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("[3] browser draw: skipped (playwright not installed)")
        return
    import base64
    from workbench.widgets.page_map import JS, PALETTE, encode, layout
    states = random_states(n, k=4)
    codes = [base64.b64encode(encode(s.states, s.owner)).decode() for s in states]
    cols, cell = layout(n, 640, 360)
    html = (f"<html><body><canvas id=c></canvas><script type=module>{JS.read_text()}\n"
            f"const frames = {json.dumps(codes)}.map(bytesOf); const pal = bytesOf('{base64.b64encode(PALETTE.tobytes()).decode()}');"
            f"const c = document.getElementById('c');"
            f"window.bench = (k) => {{ const t = performance.now(); for (let i = 0; i < k; i++) "
            f"draw(c, {{codes: frames[i % frames.length], palette: pal, cols: {cols}, cell: {cell}, numPages: {n}}});"
            f" return performance.now() - t; }}; window.ready = true;</script></body></html>")
    with tempfile.NamedTemporaryFile("w", suffix=".html", delete=False) as f:
        f.write(html)
    try:
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu",
                                                                    "--disable-dev-shm-usage"])
            page = b.new_page()
            page.goto("file://" + f.name)
            page.wait_for_function("window.ready === true")
            page.evaluate("window.bench(3)")
            ms = page.evaluate(f"window.bench({draws})")
            b.close()
        print(f"[3] browser draw (page_map.js in Chromium), {n:,} pages: {draws / ms * 1e3:8.1f} draws/s "
              f"({ms / draws:.1f} ms each)")
    finally:
        os.unlink(f.name)


def tiny_model_dir() -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    path = os.path.join(tempfile.gettempdir(), "kvwb-bench-tiny-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def bench_engine(model: str, repeats: int, requests: int, new_tokens: int) -> None:
    from workbench import Engine, EngineConfig, SamplingParams, Workbench
    from workbench.widgets.dashboard import MAX_SHARE
    cfg = EngineConfig(num_pages=2048)
    eng = Engine.from_default(cfg) if model == "smollm2" else Engine.from_pretrained(tiny_model_dir(), cfg)
    vocab = eng.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, int(rng.integers(16, 200))).tolist() for _ in range(requests)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    probes = ("pool", "page_table", "cu_seqlens", "lock_contention")

    def run(with_dashboard: bool) -> tuple[float, int]:
        wb = Workbench(eng).attach(*probes)
        dash = wb.dashboard() if with_dashboard else None
        r0, b0 = (dash.refreshes, dash.busy_s) if dash else (0, 0.0)     # not the first draw: it precedes the run
        eng.reset_prefix_cache()              # each run computes its prompts, as the first one did
        t = time.perf_counter()
        wb.run(prompts, params)
        dt = time.perf_counter() - t
        busy = (dash.refreshes - r0, dash.busy_s - b0) if dash else (0, 0.0)
        if dash:
            dash.close()
        wb.detach()
        wb.log.detach()
        return dt, busy

    eng.generate(prompts[:2], SamplingParams(max_tokens=2))      # warm-up
    off, on, refreshes, share = [], [], [], []
    for _ in range(repeats):                                    # alternate, so drift hits both
        off.append(run(False)[0])
        dt, (r, busy) = run(True)
        on.append(dt)
        refreshes.append(r)
        share.append(busy / dt)
    toks = requests * new_tokens
    t_off, t_on = statistics.median(off), statistics.median(on)
    print(f"[4] engine ({model}, {requests} requests x {new_tokens} tokens, probes {', '.join(probes)} + log):")
    print(f"      without dashboard: {toks / t_off:8.1f} tok/s ({t_off:.2f} s)")
    print(f"      dashboard live   : {toks / t_on:8.1f} tok/s ({t_on:.2f} s, {statistics.median(refreshes):.0f} "
          f"refreshes, <= 10 Hz)")
    print(f"      throughput change: {t_off / t_on - 1:+.1%} (medians of {repeats} alternating runs; noisy on a "
          f"shared machine)")
    print(f"      time the engine thread spent in dashboard refreshes: {statistics.median(share):.1%} of the run "
          f"(the throttle's bound: {MAX_SHARE:.0%})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=131_072)
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    install_comm()
    bench_serialise(a.pages)
    bench_live_path(a.pages)
    bench_browser(a.pages)
    bench_engine(a.model, a.repeats, a.requests, a.new_tokens)


if __name__ == "__main__":
    main()
