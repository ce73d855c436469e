"""kvwb diff: divergence triage of two sides (identical, drift or corruption, per request)."""
from __future__ import annotations

import argparse
import sys


def _args_diff(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="side A: engine[:MODEL][?key=value&...] (EngineConfig fields, e.g. "
                             "engine?dtype=bfloat16&page_size=64; MODEL: a GGUF or HF directory, default SmolLM2) "
                             "or hf:DIR (transformers, float32), a vLLM server URL (http://HOST:PORT), or a flight "
                             "recording directory (its greedy requests and the tokens they produced: the reference)")
    p.add_argument("b", help="side B, the same forms")
    p.add_argument("--prompts", default=None, metavar="TRACE",
                   help="prompts from a trace or recording with token ids (default: 8 synthetic prompts sharing a prefix)")
    p.add_argument("--limit", type=int, default=8, help="at most this many prompts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--forced", choices=("decode", "prefill"), default="decode",
                   help="how an engine side B is teacher-forced: through its decode path (default: what "
                        "production ran; a decode-path fault shows) or its prefill (prompt log-probs: faster, "
                        "blind to decode-path faults)")
    p.add_argument("--time", action="store_true", help="print where the triage's time went, phase by phase")


def _side(spec: str):
    from urllib.parse import parse_qsl
    from workbench.engine.config import EngineConfig
    from workbench.recorder.reader import is_recording
    if spec.startswith("hf:"):
        return spec[3:]
    if spec.startswith(("http://", "https://")):
        return spec
    if is_recording(spec):
        from workbench.diverge.sides import RecordingSide
        return RecordingSide(spec)
    if not spec.startswith("engine"):
        raise ValueError(f"side {spec!r}: use engine[:MODEL][?key=value...], hf:DIR, http://HOST:PORT or a "
                         "recording directory")
    head, _, query = spec.partition("?")
    model = head.partition(":")[2] or None
    kw = {}
    for k, v in parse_qsl(query, strict_parsing=bool(query)):
        if k not in EngineConfig.__dataclass_fields__:
            raise ValueError(f"side {spec!r}: {k!r} is not an EngineConfig field")
        kw[k] = int(v) if v.isdigit() else {"true": True, "false": False}.get(v.lower(), v)
    from workbench import Engine
    cfg = EngineConfig(**kw)
    return Engine.from_pretrained(model, cfg) if model else Engine.from_default(cfg)


def cmd_diff(args: argparse.Namespace) -> int:
    from workbench.diverge import triage
    try:
        a, b = _side(args.a), _side(args.b)
        prompts = None
        if any(not getattr(x, "has_logprobs", True) for x in (a, b)):
            pass                                      # a recording brings its own requests
        elif args.prompts:
            from workbench.recorder.reader import load_trace
            prompts = [r.prompt_token_ids for r in load_trace(args.prompts) if r.prompt_token_ids][:args.limit]
            if not prompts:
                raise ValueError(f"{args.prompts}: no request with prompt token ids")
        else:
            import numpy as np
            vocab = min([1000] + [x.model_config.vocab_size for x in (a, b) if hasattr(x, "model_config")])
            rng = np.random.default_rng(0)
            pre = rng.integers(3, vocab, 40).tolist()
            prompts = [pre + rng.integers(3, vocab, int(k)).tolist() for k in rng.integers(3, 30, args.limit)]
    except (ValueError, OSError) as e:
        print(f"kvwb diff: {e}", file=sys.stderr)
        return 2
    from workbench.diverge import EngineSide
    from workbench.engine import Engine
    if not getattr(b, "has_logprobs", True) and isinstance(a, Engine):    # B a recording: A is the forced side
        a = EngineSide(a, name="A", forced=args.forced)
    elif isinstance(b, Engine):
        b = EngineSide(b, name="B", forced=args.forced)
    elif args.forced != "decode":
        print(f"kvwb diff: --forced {args.forced} needs an engine side to force; B is {args.b}", file=sys.stderr)
        return 2
    rep = triage(a, b, prompts, max_tokens=args.max_tokens)
    print(rep.summary())
    if args.time:
        print("  time: " + ", ".join(f"{k} {v:.1f} s" for k, v in rep.seconds.items()))
    for row in rep.rows:
        print(f"  request {row['request']}: {row['verdict']}"
              + (f" from token {row['first_token']}" if row["first_token"] is not None else "")
              + (f", layer {row['layer']}, pages {row['pages']}" if row["layer"] is not None else "")
              + f": {row['evidence']}")
    return 1 if any(r["verdict"] == "corruption" for r in rep.rows) else 0
