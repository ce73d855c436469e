"""The flight recorder's cost, recorder on vs off, in one interleaved run: in vLLM and in our engine.

vLLM: two of vLLM's real EngineCores (inproc.py, the tiny model of vllm_plugin_overhead.py), both
with the plugin's checks on, one recording (PAGEDKV_RECORD_DIR) and one not (PAGEDKV_RECORD=0),
the same rounds in turn, pairs with the start order swapped. Our engine: two Engines on a tiny
random Llama, record_dir set on one, the same rounds in turn. Printed: median step time off and
on and their ratio (goal: <= 1% of step time), and what the recording holds: bytes per request
and per step.

    .venv/bin/python benchmarks/recorder_overhead.py [--rounds 6] [--pairs 2] [--blocks 10000]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tqdm.auto import tqdm  # noqa: E402

from vllm_plugin_overhead import Engine as VllmEngine  # noqa: E402
from workbench.adapters.vllm.listener import SanitizerListener  # noqa: E402
from workbench.adapters.vllm.server import free_port  # noqa: E402
from workbench.adapters.vllm.tiny_model import write_tiny_model_dir  # noqa: E402
from workbench.recorder.reader import open_recording  # noqa: E402


def sizes(root: Path) -> tuple[int, int, int]:
    """(bytes, requests, steps) of the recording(s) under root."""
    dirs = [d for d in [root, *root.rglob("*")] if d.is_dir() and list(d.glob("seg-*.jsonl"))
            and d.parent.name != "bundles"]
    b = r = s = 0
    for d in dirs:
        rec = open_recording(d)
        b += sum(p.stat().st_size for p in d.glob("seg-*.jsonl"))
        r += len(rec.requests)
        s += sum(1 for n, _ in rec.events if n == "StepFinished")
    return b, r, s


def vllm_pair(model, blocks: int, a, on_first: bool) -> dict:
    san = f"tcp://127.0.0.1:{free_port()}"
    lis = SanitizerListener(san)
    rec_dir = Path(tempfile.mkdtemp(prefix="kvwb-rec-bench-"))
    mk_on = lambda: VllmEngine(model, blocks, san, {"PAGEDKV_RECORD_DIR": str(rec_dir)})   # noqa: E731
    mk_off = lambda: VllmEngine(model, blocks, san, {"PAGEDKV_RECORD": "0"})               # noqa: E731
    on, off = (mk_on(), mk_off()) if on_first else (mk_off(), mk_on())[::-1]
    steps = {"off": [], "on": []}
    try:
        for e in (on, off):
            e.round(a.requests, a.max_tokens, seed=10_000)
        for r in tqdm(range(a.rounds), desc=f"vLLM {blocks} blocks", leave=False):
            for name, eng in (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off)):
                steps[name] += eng.round(a.requests, a.max_tokens, seed=r)
    finally:
        on.close()
        off.close()
        lis.close()
    b, nreq, nstep = sizes(rec_dir)
    return {"off": statistics.median(steps["off"]), "on": statistics.median(steps["on"]), "n": len(steps["on"]),
            "bytes": b, "requests": nreq, "steps": nstep}


def engine_pair(a) -> dict:
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench import Engine, EngineConfig, SamplingParams
    rec_dir = Path(tempfile.mkdtemp(prefix="kvwb-rec-bench-"))
    if a.engine_model == "smollm2":
        off = Engine.from_default(EngineConfig(num_pages=2048))
        on = Engine.from_default(EngineConfig(num_pages=2048, record_dir=str(rec_dir)))
    else:
        d = Path(tempfile.mkdtemp(prefix="kvwb-tiny-llama-"))
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(d)
        off = Engine.from_pretrained(d, EngineConfig(num_pages=2048))
        on = Engine.from_pretrained(d, EngineConfig(num_pages=2048, record_dir=str(rec_dir)))
    steps = {"off": [], "on": []}

    def round_(eng, seed):
        rng = np.random.default_rng(seed)
        pre = rng.integers(3, 256, 64).tolist()
        for _ in range(a.requests):
            eng.add_request(pre + rng.integers(3, 256, 16).tolist(), SamplingParams(max_tokens=a.max_tokens,
                                                                                  ignore_eos=True))
        out = []
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            out.append(time.perf_counter() - t0)
        return out
    for e in (on, off):
        round_(e, 10_000)
    for r in tqdm(range(a.rounds), desc="our engine", leave=False):
        for name, eng in (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off)):
            steps[name] += round_(eng, r)
    on.recorder.close()
    b, nreq, nstep = sizes(rec_dir)
    return {"off": statistics.median(steps["off"]), "on": statistics.median(steps["on"]), "n": len(steps["on"]),
            "bytes": b, "requests": nreq, "steps": nstep}


def report(name: str, ms: list[dict]) -> None:
    for i, m in enumerate(ms):
        print(f"  {name}, pair {i + 1}: median step {1e3 * m['off']:.3f} ms off, {1e3 * m['on']:.3f} ms on: "
              f"on / off = {m['on'] / m['off']:.3f} over {m['n']} steps each; recorded {m['bytes'] / 1e3:.0f} kB: "
              f"{m['bytes'] / max(1, m['requests']):.0f} B a request ({m['requests']}) or "
              f"{m['bytes'] / max(1, m['steps']):.0f} B a step ({m['steps']})")
    g = statistics.geometric_mean([m["on"] / m["off"] for m in ms])
    print(f"  {name}: recorder on / off = {g:.3f} ({g - 1:+.1%}), geometric mean of the pairs")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--engine-model", choices=["tiny", "smollm2"], default="tiny",
                    help="our engine's model: a tiny random Llama (sub-millisecond steps: a pessimistic bound) "
                         "or SmolLM2, the default model")
    a = ap.parse_args(argv)
    print(f"flight recorder on vs off, {a.requests} requests x {a.max_tokens} tokens a round, {a.rounds} rounds, "
          f"interleaved:")
    if not a.skip_vllm:
        model = write_tiny_model_dir()
        report("vLLM EngineCore (tiny model, plugin checks on in both)",
               [vllm_pair(model, a.blocks, a, on_first=p % 2 == 1) for p in range(a.pairs)])
    report(f"our engine ({'tiny Llama' if a.engine_model == 'tiny' else 'SmolLM2'})",
           [engine_pair(a) for _ in range(a.pairs)])


if __name__ == "__main__":
    main()
