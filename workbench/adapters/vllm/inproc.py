"""vLLM's real EngineCore, in one process, driven step by step: for tests and the plugin benchmark.

Run with the vLLM environment's Python (make vllm). It builds the VllmConfig as vLLM's own
EngineArgs does, makes vLLM's EngineCore (its scheduler, KV cache manager, block pool,
UniProcExecutor, CPU worker and model runner) and calls `EngineCore.step_fn` until every
request is done, as EngineCoreProc's busy loop does. vLLM loads its general plugins inside
EngineCore.__init__, so the workbench's plugin is on exactly when PAGEDKV_VLLM_SANITIZER is
set, as in a server.

`--batch-queue` drives the path the CPU build cannot reach from its server: vLLM's CPU
platform forces `async_scheduling` off, and without it `max_concurrent_batches` is 1. Set
back on after the platform's check (the only change), vLLM itself picks its AsyncScheduler
and `EngineCore.step_with_batch_queue` with a queue of 2, the same code async scheduling
runs on CUDA; the executor hands back futures (non_block=True) as it does there. The model
runner is the CPU one (V1), which is what this machine has.

    .venv-vllm/bin/python -m workbench.adapters.vllm.inproc --batch-queue --requests 8
    prints one JSON object: {"step_fn", "scheduler", "batch_queue_size", "outputs": {id: token ids}, ...}
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import os
import sys
import time


def make_core(model: str, *, batch_queue: bool, block_size: int = 32, num_blocks: int | None = None,
              max_num_seqs: int = 8, max_model_len: int = 1024, dtype: str = "bfloat16",
              max_num_batched_tokens: int | None = None):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import Executor
    kw = {}
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    args = EngineArgs(model=model, dtype=dtype, max_model_len=max_model_len, block_size=block_size,
                      enforce_eager=True, max_num_seqs=max_num_seqs, enable_prefix_caching=True,
                      num_gpu_blocks_override=num_blocks, **kw)
    cfg = args.create_engine_config()
    if batch_queue:
        cfg.scheduler_config.async_scheduling = True      # undo the CPU platform's override, nothing else
    return EngineCore(cfg, Executor.get_class(cfg), log_stats=False)


def request(rid: str, ids: list[int], max_tokens: int):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    return EngineCoreRequest(request_id=rid, prompt_token_ids=ids, mm_features=None, sampling_params=sp,
                             pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
                             data_parallel_rank=None)


def prompts(n: int, shared: int = 70, seed: int = 0, differ_at: int | None = None) -> list[list[int]]:
    """n prompts sharing a `shared`-token prefix (prefix-cache hits), each with its own tail;
    differ_at: request i > 0 has its own token at that position of the shared prefix."""
    import random
    rng = random.Random(seed)
    head = [1] + [rng.randrange(200, 20000) for _ in range(shared - 1)]
    out = [head + [rng.randrange(200, 20000) for _ in range(17 + 13 * i % 60)] for i in range(n)]
    if differ_at is not None:
        for i, p in enumerate(out[1:], start=1):
            p[differ_at] = 20000 + i
    return out


def run(core, reqs: list[tuple[str, list[int]]], max_tokens: int, abort: dict | None = None,
        max_steps: int = 100_000, stagger: int = 0, at: dict | None = None, lengths: dict | None = None,
        reset_prefix: dict | None = None) -> dict:
    """Add the requests (one every `stagger` steps, or all at once; `at`: {request id: the step to
    add it before}, a recording's schedule), step until all are done; abort {request id: after this
    many steps}; lengths {request id: max tokens} overrides max_tokens; reset_prefix {step: whether
    running requests are preempted for it}: vLLM's reset_prefix_cache before that step (and, for
    step 0, after the run), as an RLHF weight update or a benchmark harness calls it."""
    pending = list(reqs)
    lengths = lengths or {}

    def add(n):
        for rid, ids in pending[:n]:
            r, wave = core.preprocess_add_request(request(rid, ids, lengths.get(rid, max_tokens)))
            core.add_request(r, wave)
        del pending[:n]
    if at is not None:
        pending.sort(key=lambda x: at.get(x[0], 0))
    add(sum(1 for rid, _ in pending if at.get(rid, 0) <= 1) if at is not None else 1 if stagger else len(pending))
    outputs: dict[str, list[int]] = {rid: [] for rid, _ in reqs}
    logprobs: dict[str, list[float]] = {rid: [] for rid, _ in reqs}      # of each sampled token
    finished: dict[str, str] = {}
    step_s: list[float] = []
    preempted: dict[str, int] = {}
    steps = 0
    abort = dict(abort or {})
    reset_prefix = dict(reset_prefix or {})
    resets: list[tuple[int, bool]] = []
    while (core.scheduler.has_requests() or core.batch_queue or pending) and steps < max_steps:
        if steps in reset_prefix and steps:
            resets.append((steps, bool(core.reset_prefix_cache(reset_running_requests=reset_prefix.pop(steps)))))
        if pending and at is not None:
            add(sum(1 for rid, _ in pending if at.get(rid, 0) <= steps + 1))
        elif pending and steps % stagger == 0 and steps:
            add(1)
        for rid, after in list(abort.items()):
            if steps >= after:
                core.abort_requests([rid])
                del abort[rid]
        t0 = time.perf_counter()
        outs, _ = core.step_fn()
        step_s.append(time.perf_counter() - t0)
        steps += 1
        for rid, r in core.scheduler.requests.items():      # vLLM counts each request's preemptions
            preempted[rid] = getattr(r, "num_preemptions", 0)
        for o in (outs or {}).values():
            for x in o.outputs:
                outputs.setdefault(x.request_id, []).extend(x.new_token_ids)
                if x.new_logprobs is not None:
                    logprobs.setdefault(x.request_id, []).extend(
                        float(v) for v in np.asarray(x.new_logprobs.logprobs)[:, 0])
                if x.finish_reason is not None:
                    finished[x.request_id] = str(x.finish_reason)
    if 0 in reset_prefix:                                   # after the run: nothing holds a block
        resets.append((steps, bool(core.reset_prefix_cache(reset_running_requests=reset_prefix.pop(0)))))
    return {"steps": steps, "outputs": outputs, "logprobs": logprobs, "finished": finished, "step_s": step_s,
            "preemptions": sum(preempted.values()), "preempted": {r: n for r, n in preempted.items() if n},
            "prefix_resets": resets}


def serve(core, seed0: int = 0) -> None:
    """Rounds on demand, for a benchmark that interleaves engines: each stdin line
    {"requests": n, "max_tokens": m, "seed": s} runs one round; one RESULT line answers it."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        ps = prompts(int(cmd["requests"]), seed=int(cmd.get("seed", seed0)))
        tag = cmd.get("seed", 0)
        res = run(core, [(f"s{tag}-r{i}", p) for i, p in enumerate(ps)], int(cmd["max_tokens"]))
        res.pop("outputs")
        res.pop("logprobs")
        sys.stdout.write("RESULT " + json.dumps(res) + "\n")
        sys.stdout.flush()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-queue", action="store_true")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--abort", action="append", default=[], metavar="ID:STEP")
    ap.add_argument("--abort-every", type=int, default=0, metavar="K",
                    help="abort every Kth request, 3 steps after it is added (a soak's clients that hang up)")
    ap.add_argument("--reset-prefix", action="append", default=[], metavar="STEP[:running]",
                    help="vLLM's reset_prefix_cache before that step (0: after the run); ':running' preempts the "
                         "running requests for it")
    ap.add_argument("--max-steps", type=int, default=100_000, help="stop stepping after this many (a hung engine)")
    ap.add_argument("--stagger", type=int, default=0, metavar="STEPS", help="add one request every STEPS steps")
    ap.add_argument("--differ-at", type=int, default=None, metavar="POS",
                    help="requests after the first differ from it at this position of the shared prefix only")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the step's token budget: below a prompt's length, prefills are chunked")
    ap.add_argument("--shared", type=int, default=70, help="tokens of prefix all prompts share")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' random seed")
    ap.add_argument("--trace", default=None, metavar="RECORDING",
                    help="the requests of a flight recording or repro bundle instead, each added before the "
                         "step it was first scheduled at, with its recorded prompt and max tokens")
    ap.add_argument("--settle-s", type=float, default=0.5, help="wait before exiting, for the last messages")
    ap.add_argument("--serve", action="store_true", help="run rounds asked for on stdin (serve())")
    ap.add_argument("--teardown", action="store_true",
                    help="end a one-shot run with vLLM's EngineCore.shutdown (skipped by default, see the end "
                         "of main; --serve always runs it)")
    a = ap.parse_args(argv)
    from .model_dir import DEFAULT_DIR
    core = make_core(a.model or str(DEFAULT_DIR), batch_queue=a.batch_queue, num_blocks=a.num_blocks,
                     max_num_seqs=a.max_num_seqs, block_size=a.block_size, max_model_len=a.max_model_len,
                     max_num_batched_tokens=a.max_num_batched_tokens)
    if a.serve:
        sys.stdout.write("READY " + json.dumps({"num_blocks": len(core.scheduler.kv_cache_manager.block_pool.blocks)})
                         + "\n")
        sys.stdout.flush()
        serve(core)
        time.sleep(a.settle_s)
        core.shutdown()
        return
    reqs = [(f"r{i}", p) for i, p in enumerate(prompts(a.requests, shared=a.shared, differ_at=a.differ_at, seed=a.seed))]
    at = lengths = None
    if a.trace:
        from workbench.recorder.reader import open_recording
        recorded = open_recording(a.trace).requests
        reqs = [(str(r["id"]), r["prompt_token_ids"]) for r in recorded]
        at = {str(r["id"]): int(r.get("step", 1)) for r in recorded}
        lengths = {str(r["id"]): int(r.get("output_len") or a.max_tokens) for r in recorded}
    abort = {x.split(":")[0]: int(x.split(":")[1]) for x in a.abort}
    if a.abort_every > 0:
        abort.update({f"r{i}": (i * a.stagger if a.stagger else 0) + 3
                      for i in range(a.abort_every - 1, len(reqs), a.abort_every)})
    resets = {int(x.split(":")[0]): x.endswith(":running") for x in a.reset_prefix}
    res = run(core, reqs, a.max_tokens, abort, stagger=a.stagger, max_steps=a.max_steps, at=at, lengths=lengths,
              reset_prefix=resets)
    pool = core.scheduler.kv_cache_manager.block_pool
    # the pool after the run, read directly: a fault that corrupts it shows here whatever the checks say
    res.update(num_free_after=pool.get_num_free_blocks(), min_ref_cnt=min(b.ref_cnt for b in pool.blocks if not b.is_null),
               kv_cache_groups=[type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups])
    res.update(step_fn=core.step_fn.__name__, scheduler=type(core.scheduler).__name__,
               batch_queue_size=core.batch_queue_size, num_blocks=len(core.scheduler.kv_cache_manager.block_pool.blocks))
    res["plugin_sizes"] = plugin_sizes()
    time.sleep(a.settle_s)
    # The process ends right after this. vLLM's teardown (EngineCore.shutdown) releases what the exit
    # releases anyway, and pays for it: it unfreezes the heap and collects it twice over, ~0.8 s of a
    # ~4 s test run here. What a run checks is read above (the result, plugin_sizes), the plugin hooks
    # nothing of the teardown, and the real servers' tests (and --teardown) still run it with the plugin in.
    if a.teardown:
        core.shutdown()
    sys.stdout.write("RESULT " + json.dumps(res) + "\n")
    sys.stdout.flush()


def plugin_sizes() -> dict:
    """The plugin's per-request and per-block structures in this process, by name (empty without it):
    what must fall back once every request is done, whatever path ended it."""
    import sys as _sys
    hooks = _sys.modules.get("workbench.adapters.vllm.hooks")
    pool = getattr(hooks, "POOL", None)
    if pool is None:
        return {}
    out = {"crc": len(pool.crc), "progress": len(pool.progress), "progress_t": len(pool.progress_t),
           "t_sched": len(pool.t_sched), "touched": len(pool.touched),
           "ledger_requests": len(pool.ledger.reqs) if pool.ledger is not None else 0,
           "provenance_records": sum(len(p.rec) for p in pool.prov.values()), "prefix_resets": pool.prefix_resets,
           # the checks' own thread (aside.py): jobs run there, and vLLM's thread's wait for them
           "check_thread_jobs": pool.aside.jobs if pool.aside.threaded else 0, "check_wait_s": pool.aside.waited_s}
    req = getattr(hooks, "REQ", None)
    if req is not None:
        out["books_live"] = len(req.books.live)
    return out


if __name__ == "__main__":
    main()
