"""The worker-side checks (the metadata check, the attention check) make no blocking host read of a
device tensor, per step.

The CPU build cannot show a stream sync, so the device is a double: a tensor subclass that says it
lives on "cuda:0" (its bytes stay on the CPU) and counts every read that would wait for the stream
on a real device (.to("cpu") / .cpu() / .numpy() / .tolist() / .item(), a blocking copy_ to the
host), while a non_blocking copy_ into a host buffer is counted apart. MetadataWatch.check runs on
fakes of vLLM's runner, builder, SchedulerOutput and CommonAttentionMetadata shaped like the real
ones (the same attributes the plugin reads), for several steps: 0 blocking reads, the copies are
non-blocking, and the check is judged at the next execution, naming the right request when the
block table the kernel reads is wrong. The attention check runs the same way on a backend of the
test's own over a KV cache "on the device", with every tensor derived from device data counted too.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import torch

from workbench.adapters.vllm import settings as vs
from workbench.adapters.vllm.worker_side import MetadataWatch

FAKE = torch.device("cuda", 0)
COUNT = {"blocking": 0, "non_blocking": 0}
BLOCKING = {"to", "cpu", "numpy", "tolist", "item", "__array__", "__index__", "__int__"}


class DeviceDouble(torch.Tensor):
    """A tensor that reports device cuda:0 and counts host reads that would block on one."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if getattr(func, "__self__", None) is torch.Tensor.device:      # the .device property
            return FAKE
        if name in BLOCKING and not (name == "to" and not _to_host(args, kwargs)):
            COUNT["blocking"] += 1
        if name == "copy_" and len(args) > 1 and isinstance(args[1], DeviceDouble) \
                and not isinstance(args[0], DeviceDouble):
            COUNT["non_blocking" if kwargs.get("non_blocking") or (len(args) > 2 and args[2]) else "blocking"] += 1
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name in ("__getitem__", "reshape", "view", "detach", "__get__") and isinstance(out, torch.Tensor):
            return out.as_subclass(DeviceDouble)
        return out


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return str(target).startswith("cpu")


def dev(a) -> DeviceDouble:
    return torch.as_tensor(np.asarray(a)).as_subclass(DeviceDouble)


class FullAttentionSpec(NS):
    pass


def step_inputs(rows, bs, swap_rows=False):
    """(SchedulerOutput-like, CommonAttentionMetadata-like) for rows: (req id, computed, scheduled, blocks)."""
    n = len(rows)
    q = [s for _, _, s, _ in rows]
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    width = max(len(b) for *_, b in rows)
    bt = np.zeros((n, width), dtype=np.int32)
    for i, (*_, b) in enumerate(rows):
        bt[i, :len(b)] = b
    pos = np.concatenate([np.arange(c, c + s) for _, c, s, _ in rows])
    slots = np.concatenate([np.asarray(b)[np.arange(c, c + s) // bs] * bs + np.arange(c, c + s) % bs
                            for _, c, s, b in rows])
    if swap_rows:
        bt[[0, 1]] = bt[[1, 0]]
    cm = NS(query_start_loc_cpu=torch.as_tensor(qsl), num_reqs=n, seq_lens=dev([c + s for _, c, s, _ in rows]),
            positions=dev(pos), block_table_tensor=dev(bt), slot_mapping=dev(slots.astype(np.int64)))
    return cm


def test_the_metadata_check_reads_no_device_tensor_with_a_blocking_copy():
    bs = 16
    sent = []
    rep = NS(findings=lambda found, key: sent.extend(found), send=lambda *a, **k: None, status=lambda *a: None,
             inactive=lambda *a: None, error=lambda where, e: (_ for _ in ()).throw(e))
    w = MetadataWatch(rep, vs.Settings())
    spec = FullAttentionSpec(block_size=bs)
    runner = NS(kv_cache_config=NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["l0"])], num_blocks=64),
                input_batch=NS(req_ids=["a", "b"]), attn_groups=[])
    builder = NS(kv_cache_spec=spec, layer_names=["l0"])
    blocks = {"a": [3, 4], "b": [7, 8]}
    new = [NS(req_id=r, block_ids=(blocks[r],), num_computed_tokens=0) for r in ("a", "b")]
    so = NS(scheduled_new_reqs=new, scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                            resumed_req_ids=set()),
            num_scheduled_tokens={"a": 20, "b": 18}, total_num_scheduled_tokens=38, finished_req_ids=set())
    COUNT.update(blocking=0, non_blocking=0)
    w.on_execute(runner, so, False)
    w.check(builder, step_inputs([("a", 0, 20, blocks["a"]), ("b", 0, 18, blocks["b"])], bs))
    assert w.checks == 0 and len(w.copies.pending) == 1          # on a device: judged once the copies land
    for k, (ca, cb) in enumerate(((20, 18), (21, 19), (22, 20))):
        so = NS(scheduled_new_reqs=[], scheduled_cached_reqs=NS(req_ids=["a", "b"], new_block_ids=[None, None],
                                                               num_computed_tokens=[ca, cb],
                                                               resumed_req_ids=set()),
                num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2, finished_req_ids=set())
        w.on_execute(runner, so, False)
        w.check(builder, step_inputs([("a", ca, 1, blocks["a"]), ("b", cb, 1, blocks["b"])], bs,
                                     swap_rows=k == 2))
    assert COUNT["blocking"] == 0, COUNT
    assert COUNT["non_blocking"] == 4 * 4                         # seq_lens, block table, slots, positions
    assert w.checks == 3 and sent == []                           # judged one execution late, clean
    w.on_execute(runner, NS(scheduled_new_reqs=[], scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[],
                                                                          num_computed_tokens=[],
                                                                          resumed_req_ids=set()),
                            num_scheduled_tokens={}, total_num_scheduled_tokens=0, finished_req_ids=set()), False)
    assert w.checks == 4 and COUNT["blocking"] == 0
    bad = [f for f in sent if f["kind"] == "block-table"]
    assert bad and bad[0]["request_id"] in ("a", "b") and bad[0]["step"] == 4


# ---- the attention check inside vLLM's workers (attention_watch.py) on a device -------------------------

class OnDevice(DeviceDouble):
    """DeviceDouble whose every result computed from it stays "on the device": a host read anywhere down
    the chain is counted, not only one of the tensor vLLM handed over."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        if isinstance(out, torch.Tensor) and not isinstance(out, DeviceDouble) and name not in ("copy_", "to") \
                and out.device.type == "cpu":
            return out.as_subclass(OnDevice)
        return out


class FakeDevice(torch.overrides.TorchFunctionMode):
    """Tensors created on, or moved to, cuda:0 stay on the CPU as OnDevice doubles (this torch has no CUDA)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        fake = lambda d: isinstance(d, (torch.device, str)) and str(d).startswith("cuda")  # noqa: E731
        onto = fake(kwargs.get("device")) or (getattr(func, "__name__", "") == "to" and any(map(fake, args[1:])))
        if onto:
            kwargs = {k: ("cpu" if k == "device" else v) for k, v in kwargs.items()}
            args = tuple("cpu" if fake(a) else a for a in args)
        out = func(*args, **kwargs)
        return out.as_subclass(OnDevice) if onto and isinstance(out, torch.Tensor) else out


def test_the_attention_check_copies_without_blocking_and_judges_a_later_execution():
    """AttentionWatch on device tensors (q / k / v / output / KV cache on "cuda:0"): every host copy is
    non-blocking into a host buffer, the check of execution e is judged at execution e + 1, and a backend
    that attends with twice the scale is named (request, layer, explanation) from the copies alone."""
    from probes import attention_math as am
    from workbench.adapters.vllm.attention_watch import AttentionWatch

    H, HKV, D, BS = 4, 2, 32, 16
    scale = D ** -0.5
    sent = []
    rep = NS(findings=lambda found, key: sent.extend(found), send=lambda *a, **k: None, status=lambda *a: None,
             inactive=lambda *a: None, error=lambda where, e: (_ for _ in ()).throw(e))
    blocks = {"a": [3, 4], "b": [7, 8, 9]}
    reqs = {"a": NS(computed=20, scheduled=1, groups=[blocks["a"]]), "b": NS(computed=40, scheduled=1,
                                                                            groups=[blocks["b"]])}
    meta = NS(runner=NS(), last_so=NS(scheduled_spec_decode_tokens=None, total_num_scheduled_tokens=2),
              executions=0, req_ids=["a", "b"], ledger=NS(reqs=reqs))
    w = AttentionWatch(rep, vs.Settings(), meta)
    name = "model.layers.0.self_attn.attn"
    w.layers[name] = {"index": 0, "group": 0, "layout": "flash", "window": 0, "chunk": 0, "softcap": 0.0,
                      "scale": scale, "heads": H, "head_size": D, "block_size": BS}
    w.order = [name]
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(16, HKV, BS, 2 * D)                  # "flash" layout: [blocks, Hkv, slots, K | V]
    hist = {r: (torch.randn(64, HKV, D, generator=g), torch.randn(64, HKV, D, generator=g)) for r in reqs}
    for r, (k, v) in hist.items():                          # the context the requests computed before
        for t in range(reqs[r].computed):
            cache[blocks[r][t // BS], :, t % BS] = torch.cat([k[t], v[t]], -1)
    bug = {"on": False}

    def backend(layer, query, key, value, kv_cache, md, output):
        """A backend of our own: stores the step's K/V at their slots, attends over each request's context."""
        with torch._C.DisableTorchFunction():          # the backend itself is not what is checked
            c, q, o = kv_cache.as_subclass(torch.Tensor), query.as_subclass(torch.Tensor), \
                output.as_subclass(torch.Tensor)
            for i, r in enumerate(("a", "b")):
                t = reqs[r].computed
                c[blocks[r][t // BS], :, t % BS] = torch.cat([key.as_subclass(torch.Tensor)[i],
                                                              value.as_subclass(torch.Tensor)[i]], -1)
                ks = c[blocks[r]].transpose(1, 2).reshape(-1, HKV, 2 * D)[: t + 1]
                s = scale * (2 if bug["on"] and r == "b" else 1)
                allowed = am.causal(torch.tensor([t]), t + 1)
                o[i] = am.attend(q[i:i + 1], ks[..., :D], ks[..., D:], allowed, s).reshape(-1)
        return output

    forward = w._wrap(name, backend)
    COUNT.update(blocking=0, non_blocking=0)
    with FakeDevice():
        kv_cache = cache.as_subclass(OnDevice)
        for e in range(1, 9):
            meta.executions = e
            bug["on"] = e >= 5
            q = torch.randn(2, H, D, generator=g).to("cuda:0")
            k = torch.stack([hist[r][0][reqs[r].computed] for r in ("a", "b")]).to("cuda:0")
            v = torch.stack([hist[r][1][reqs[r].computed] for r in ("a", "b")]).to("cuda:0")
            out = torch.empty(2, H * D).to("cuda:0")
            assert out.device.type == "cuda" and isinstance(out, OnDevice)
            forward(NS(), q, k, v, kv_cache, NS(), out)
            assert w.checks == e - 1, (e, w.checks)           # this execution's check waits for its copies
            assert len(w._pending) == 1
            for r in reqs.values():
                r.computed += 1
    assert COUNT["blocking"] == 0, COUNT
    assert COUNT["non_blocking"] >= 8 * 6                  # q, K, V handed over; the stored K, V; the output
    clean = [f for f in sent if f["step"] < 5]
    assert clean == [], clean
    named = [f for f in sent if f["kind"] == "attention-read"]
    assert named and {f["request_id"] for f in named} == {"b"}, sent
    for f in named:
        ev = f["evidence"]
        assert f["step"] >= 5 and ev["layer"] == 0 and ev["layer_name"] == name and ev["row_kind"] == "decode", f
        assert ev["explanation"] == "scale" and "twice the model's" in f["message"], f["message"]
        assert ev["position"] == reqs["b"].computed - 8 + (f["step"] - 1) and f["page"] in blocks["b"], f
