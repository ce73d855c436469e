"""Run prompts through the engine, on one device or tensor parallel; the same command under torchrun.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29511 \\
        -m workbench.serve --prompt "What is the capital of France?" --chat --max-tokens 32
    python -m workbench.serve --tensor-parallel-size 2 --prompt "..."    # spawns its own workers

Under torchrun every process runs this module: rank 0 builds the Engine (tensor_parallel_size =
the world size; it joins torchrun's ranks instead of spawning) and prints one JSON line per
prompt ({"prompt", "text", "token_ids", "finish_reason"}); every other rank serves rank 0's
plans until it shuts down. The model is the default SmolLM2-135M unless --model names a GGUF
file or a Hugging Face directory. --probe attaches probes (e.g. rank_consistency) and prints
their findings as JSON lines ({"finding": ...}) after the outputs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m workbench.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file or a HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="ranks (default: torchrun's world size, else 1)")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for more)")
    ap.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    ap.add_argument("--prompts-file", default=None, help="JSONL: one {\"prompt\": text | [ids] | [messages]} a line")
    ap.add_argument("--chat", action="store_true", help="send each --prompt as one user message")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--probe", action="append", default=[], help="attach this probe (repeat for more)")
    return ap.parse_args(argv)


def prompts_of(a: argparse.Namespace) -> list:
    out: list = [[{"role": "user", "content": p}] if a.chat else p for p in a.prompt]
    out += [[int(t) for t in s.split(",") if t.strip()] for s in a.prompt_ids]
    if a.prompts_file:
        with open(a.prompts_file, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append(json.loads(line)["prompt"])
                    except (ValueError, KeyError) as e:
                        raise SystemExit(f"{a.prompts_file}:{i}: not a JSON object with a 'prompt': {e}")
    return out


def main(argv=None) -> int:
    from workbench.engine.parallel.group import under_torchrun
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        from workbench.engine.parallel.worker import serve_torchrun
        code = serve_torchrun()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)          # gloo's threads must not meet the interpreter's teardown
    a = parse(argv)
    from workbench import Engine, EngineConfig, SamplingParams, Workbench
    tp = a.tensor_parallel_size or (int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1)
    cfg = EngineConfig(tensor_parallel_size=tp, num_pages=a.num_pages, max_num_batched_tokens=a.max_num_batched_tokens)
    prompts = prompts_of(a)
    if not prompts:
        print("workbench.serve: no prompt given (--prompt, --prompt-ids or --prompts-file)", file=sys.stderr)
    engine = Engine.from_pretrained(a.model, cfg) if a.model else Engine.from_default(cfg)
    try:
        wb = Workbench(engine, log=False).attach(*a.probe) if a.probe else None
        params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=a.ignore_eos)
        for p, o in zip(prompts, engine.generate(prompts, params) if prompts else []):
            print(json.dumps({"prompt": p, "text": o.text if engine.tokenizer is not None else None,
                              "token_ids": o.token_ids, "finish_reason": o.finish_reason}), flush=True)
        if wb is not None:
            for f in wb.all_findings():
                print(json.dumps({"finding": {"probe": f.probe, "kind": f.kind, "severity": f.severity,
                                              "step": f.step, "request_id": f.request_id, "message": f.message}},
                                 default=str), flush=True)
            wb.detach()
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
