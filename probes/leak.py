"""LeakProbe: memory that grows step after step, and the buffer that grows.

Field note 7: a fresh cu_seqlens tensor every step, kept alive by the runtime's lazy
GC, ran a node out of memory after ~24 h (sglang #5375: ~500 MB per node in 3 h).
Each sampled step this probe records
- engine-owned bytes: the KV cache, the batch builder's buffers, anything registered
  with register_buffer(), per name;
- per-step batch tensors: a PackedBatch index tensor (cu_seqlens, slot_mapping, ...)
  that is not a view of the builder's preallocated buffers is fresh; the probe keeps a
  weak reference to its storage and counts the ones still alive steps later (retained);
- the process's RssAnon + VmSwap (not RSS: file pages come and go), and device memory
  where there is a device;
- every census_every samples, the live torch tensors (a gc walk: expensive, so sampled).
A finding needs steady growth over `window` samples of at least min_growth_bytes (or a
per-step tensor retained from every step of the window), and names what grew.
"""
from __future__ import annotations

import gc
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass

import torch

from workbench.events import StepFinished
from workbench.probe import Probe

# PackedBatch fields that must be views of the builder's reused buffers.
BATCH_TENSORS = ("input_ids", "positions", "cu_seqlens_q", "cu_seqlens_k", "slot_mapping", "context_lens",
                 "block_tables", "logits_indices")

_REGISTRY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def register_buffer(engine, name: str, obj) -> None:
    """Count obj (a tensor, a container of tensors, or a callable returning one) as engine-owned."""
    _REGISTRY.setdefault(engine, {})[name] = obj


def _storages(obj, out: dict, depth: int = 0) -> None:
    """Collect distinct tensor storages (data_ptr -> bytes) reachable in obj."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        out[st.data_ptr()] = st.nbytes()
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, out, depth + 1)
    elif isinstance(obj, (list, tuple, set, deque)):
        for v in obj:
            _storages(v, out, depth + 1)
    elif hasattr(obj, "__dict__") and depth < 2:
        for v in vars(obj).values():
            if isinstance(v, (torch.Tensor, list, tuple, dict)):
                _storages(v, out, depth + 1)


def engine_buffers(engine) -> dict[str, int]:
    """Bytes of every buffer the engine holds, by name."""
    out = {}
    kv: dict = {}
    _storages([engine.kv.k, engine.kv.v], kv)
    out["kv_cache"] = sum(kv.values())
    for name, v in vars(engine.builder).items():
        st: dict = {}
        _storages(v if isinstance(v, torch.Tensor) else [v], st)
        if st:
            out[f"builder.{name}"] = sum(st.values())
    for name, obj in _REGISTRY.get(engine, {}).items():
        st = {}
        _storages(obj() if callable(obj) and not isinstance(obj, torch.Tensor) else obj, st)
        out[name] = sum(st.values())
    return out


def _builder_ptrs(builder) -> set[int]:
    st: dict = {}
    for v in vars(builder).values():
        _storages(v if isinstance(v, torch.Tensor) else [v], st)
    return set(st)


def who_holds(obj) -> str | None:
    """Best effort: 'Owner.attr (a list of N)' for the container keeping obj alive."""
    try:
        for r in gc.get_referrers(obj):
            if isinstance(r, (list, deque, dict)):
                size = len(r)
                for r2 in gc.get_referrers(r):
                    d = getattr(r2, "__dict__", None)
                    if isinstance(d, dict) and not isinstance(r2, type):   # 3.11+: the owner itself refers
                        attr = next((k for k, v in d.items() if v is r), None)
                        if attr is not None:
                            return f"{type(r2).__name__}.{attr} (a {type(r).__name__} of {size})"
                    if isinstance(r2, dict):
                        for r3 in gc.get_referrers(r2):
                            if getattr(r3, "__dict__", None) is r2:
                                attr = next((k for k, v in r2.items() if v is r), "?")
                                return f"{type(r3).__name__}.{attr} (a {type(r).__name__} of {size})"
                return f"a {type(r).__name__} of {size}"
    except Exception:            # noqa: BLE001 - a diagnosis aid, never a failure
        return None
    return None


def steady_growth(values: list[float], min_growth: float, min_rising: float = 0.5) -> bool:
    """Grew by >= min_growth, rising in at least min_rising of the intervals, never falling
    back by more than a quarter of the growth (a warm-up jump or a sawtooth is not a leak)."""
    if len(values) < 3:
        return False
    growth = values[-1] - values[0]
    if growth < min_growth:
        return False
    rises = sum(b > a for a, b in zip(values, values[1:]))
    if rises < min_rising * (len(values) - 1):
        return False
    peak, worst = values[0], 0.0
    for v in values:
        peak = max(peak, v)
        worst = max(worst, peak - v)
    return worst <= growth / 4


@dataclass
class _Fresh:
    step: int
    field: str
    storage: weakref.ref
    tensor: weakref.ref
    nbytes: int


class LeakProbe(Probe):
    name = "leak"
    description = "steady growth of engine buffers, retained per-step tensors, RssAnon+VmSwap, device memory"

    def __init__(self, every: int = 16, window: int = 32, min_growth_bytes: int = 64 << 20,
                 retain_window: int = 32, census_every: int = 16, min_tensor_growth: int = 64, grace: int = 2,
                 max_tracked: int = 4096, max_rows: int = 100_000, **params):
        """Memory is sampled every `every` steps; growth needs `window` samples (by default 512
        steps, so a warm-up that grows while new shapes arrive is not a leak) and
        min_growth_bytes. Per-step tensors are checked every step: one retained from each of
        the last retain_window steps is a finding. The live-tensor census runs every
        census_every samples (0: never)."""
        super().__init__(every=every, window=window, min_growth_bytes=min_growth_bytes,
                         retain_window=retain_window, census_every=census_every,
                         min_tensor_growth=min_tensor_growth, grace=grace, max_tracked=max_tracked,
                         max_rows=max_rows, **params)
        self.max_rows = max_rows
        self.every = max(1, every)
        self.window = window
        self.retain_window = retain_window
        self.min_growth_bytes = min_growth_bytes
        self.census_every = census_every
        self.min_tensor_growth = min_tensor_growth
        self.grace = grace
        self._fresh: deque[_Fresh] = deque(maxlen=max_tracked)
        self._series: dict[str, deque] = {}
        self._census: deque = deque(maxlen=4)
        self._known: tuple[int, set] = (0, set())
        self._last_batch = lambda: None
        self._n = 0
        self._t0 = None

    def on_attach(self, engine) -> None:
        self._t0 = (engine.step_count, time.perf_counter())
        self.listen(StepFinished, self.on_step)

    # ---- per step -----------------------------------------------------------------
    def on_step(self, e: StepFinished) -> None:
        self._track_batch(e.step)
        self._n += 1
        if self._n % self.every:
            return
        from workbench.engine.memory import memory_stats
        eng = self.engine
        bufs = engine_buffers(eng)
        mem = memory_stats(eng.device)
        alive = self._alive(e.step)
        row = {"step": e.step, "engine_bytes": sum(bufs.values()),
               "rss_anon_bytes": mem["rss_anon_bytes"], "swap_bytes": mem["swap_bytes"],
               "host_bytes": mem["rss_anon_bytes"] + mem["swap_bytes"],
               "device_allocated_bytes": mem.get("allocated_bytes"),
               "retained_tensors": len(alive), "retained_bytes": self._bytes(alive), "live_tensors": None}
        if self.census_every and (self._n // self.every) % self.census_every == 0:
            row["live_tensors"] = self._take_census(e.step)
        self.rows.append(row)
        if len(self.rows) > self.max_rows:          # a probe must not become the leak it hunts
            del self.rows[: len(self.rows) // 2]
        self._push("host", e.step, row["host_bytes"])
        if row["device_allocated_bytes"] is not None:
            self._push("device", e.step, row["device_allocated_bytes"])
        for name, b in bufs.items():
            self._push("buf:" + name, e.step, b)
        self._check(e.step, bufs, alive)

    def _push(self, key: str, step: int, v: float) -> None:
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = deque(maxlen=self.window)
        s.append((step, v))

    # ---- per-step tensors ---------------------------------------------------------
    def _track_batch(self, step: int) -> None:
        eng = self.engine
        rec = eng.step_record
        batch = rec.batch if rec is not None else None
        if batch is None or batch is self._last_batch():
            return
        self._last_batch = weakref.ref(batch)
        b = eng.builder
        if self._known[0] != id(b):                 # the builder can be swapped (slow_page_size)
            self._known = (id(b), _builder_ptrs(b))
        known = self._known[1]
        for f in BATCH_TENSORS:
            t = getattr(batch, f, None)
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st.data_ptr() in known:
                continue
            base = t._base if t._base is not None else t
            self._fresh.append(_Fresh(step, f, weakref.ref(st), weakref.ref(base), st.nbytes()))

    def _alive(self, step: int) -> list[_Fresh]:
        """Per-step tensors older than `grace` steps whose storage is still alive."""
        return [x for x in self._fresh if x.step <= step - self.grace and x.storage() is not None]

    @staticmethod
    def _bytes(items) -> int:
        seen = {}
        for x in items:
            st = x.storage()
            if st is not None:
                seen[st.data_ptr()] = x.nbytes
        return sum(seen.values())

    def _retention(self, step: int, alive: list[_Fresh]) -> dict | None:
        """Fields whose fresh per-step tensor survived from every step of the last window."""
        lo = step - self.grace - self.retain_window
        steps_seen = {x.step for x in self._fresh if lo < x.step <= step - self.grace}
        steps_alive = {x.step for x in alive if x.step > lo}
        if len(steps_seen) < self.retain_window or len(steps_alive) < 0.9 * len(steps_seen):
            return None
        fields = Counter(x.field for x in alive)
        return {"fields": [f for f, _ in fields.most_common()], "counts": dict(fields),
                "tensors": len(alive), "bytes": self._bytes(alive)}

    # ---- census ---------------------------------------------------------------------
    def _take_census(self, step: int) -> int:
        kinds: Counter = Counter()
        T = torch.Tensor
        for o in gc.get_objects():
            if issubclass(type(o), T):          # type(), not isinstance: no attribute access on odd objects
                kinds[(str(o.dtype).removeprefix("torch."), o.dim())] += 1
        n = sum(kinds.values())
        self._census.append((step, n, kinds))
        return n

    # ---- findings ---------------------------------------------------------------------
    def _growth(self, key: str) -> tuple[bool, float, int]:
        s = self._series.get(key, ())
        if len(s) < self.window:
            return False, 0.0, 0
        vals = [v for _, v in s]
        return steady_growth(vals, self.min_growth_bytes), vals[-1] - vals[0], s[-1][0] - s[0][0]

    @staticmethod
    def _holder(alive: list[_Fresh]) -> str | None:
        """Who keeps the newest retained tensor alive (a gc walk: only when a finding is new)."""
        for x in sorted(alive, key=lambda x: -x.step):
            t = x.tensor()
            if t is not None:
                return who_holds(t)
        return None

    def _rate_note(self, grown: float, steps: int, step: int) -> str:
        s0, t0 = self._t0
        dt = time.perf_counter() - t0
        if steps <= 0 or step <= s0 or dt <= 0:
            return ""
        per_day = grown / steps * (step - s0) / dt * 86400
        return f"; at this step rate ~{per_day / 2**30:.1f} GiB a day"

    def _check(self, step: int, bufs: dict, alive: list[_Fresh]) -> None:
        ret = self._retention(step, alive)
        holder = None
        if ret is not None and "retained-step-tensors" not in self._seen:
            holder = self._holder(alive)
            names = ", ".join(ret["fields"])
            self.report(
                "error",
                f"per-step batch tensors are retained: {names} - a fresh tensor every step, still alive "
                f"{self.grace}+ steps later, from every one of the last {self.retain_window} steps "
                f"({ret['tensors']} tensors, {ret['bytes'] / 2**20:.2f} MiB so far)"
                + (f", held by {holder}" if holder else ""),
                hint="build cu_seqlens / slot_mapping / block tables into one preallocated buffer filled in "
                     "place each step (BatchBuilder's reused buffers), and drop per-step tensors after the "
                     "kernel (field note 7: flat memory for 72 h after the fix)",
                kind="retained-step-tensors", step=step, dedup="retained-step-tensors",
                evidence={**ret, "held_by": holder})
        elif any(x.step == step for x in self._fresh):
            f = sorted({x.field for x in self._fresh if x.step == step})
            self.report("info", f"fresh per-step tensors ({', '.join(f)}) instead of the builder's "
                                f"preallocated buffers: churn now, a leak under a lazy-GC runtime",
                        hint="fill the preallocated buffers in place", kind="fresh-step-tensors", step=step,
                        dedup="fresh-step-tensors", evidence={"fields": f})

        for name in bufs:
            grew, by, steps = self._growth("buf:" + name)
            if grew:
                self.report("error", f"engine buffer '{name}' grew {by / 2**20:.1f} MiB over {steps} steps, "
                                     f"steadily{self._rate_note(by, steps, step)}",
                            hint=f"'{name}' should be allocated once at start-up and reused; find what "
                                 f"appends to it", kind="engine-buffer-growth", step=step,
                            dedup=("engine-buffer-growth", name), evidence={"buffer": name, "growth_bytes": by})

        for key, what in (("host", "process anonymous memory (RssAnon + VmSwap)"),
                          ("device", f"{self.engine.device.type} allocated memory")):
            grew, by, steps = self._growth(key)
            if not grew or ("memory-growth", key) in self._seen:
                continue
            if alive and holder is None:
                holder = self._holder(alive)
            grown_bufs = [n for n in bufs if self._growth("buf:" + n)[1] > 0]
            if alive:
                fields = ", ".join(f for f, _ in Counter(x.field for x in alive).most_common())
                cause = (f"retained per-step batch tensors: {fields} ({len(alive)} tensors, "
                         f"{self._bytes(alive) / 2**20:.1f} MiB)" + (f", held by {holder}" if holder else ""))
            elif grown_bufs:
                cause = f"engine buffers that grew: {', '.join(grown_bufs)}"
            else:
                cause = "no engine buffer or per-step batch tensor grew: take a tracemalloc / memory_viz snapshot"
            self.report("error", f"{what} grew {by / 2**20:.1f} MiB over {steps} steps, steadily"
                                 f"{self._rate_note(by, steps, step)}; cause: {cause}",
                        hint="allocate per-step metadata once and fill it in place; watch RssAnon + VmSwap, "
                             "not RSS alone (field note 7)",
                        kind="memory-growth", step=step, dedup=("memory-growth", key),
                        evidence={"memory": key, "growth_bytes": by, "steps": steps, "cause": cause})

        if len(self._census) >= 3:
            counts = [n for _, n, _ in self._census]
            if all(b > a for a, b in zip(counts, counts[1:])) and counts[-1] - counts[0] >= self.min_tensor_growth:
                first, last = self._census[0][2], self._census[-1][2]
                top = sorted(((last[k] - first.get(k, 0), k) for k in last), reverse=True)[:3]
                kinds = ", ".join(f"{dt} {nd}-d +{d}" for d, (dt, nd) in top if d > 0)
                self.report("warn", f"live torch tensors rose at every census: {counts} ({kinds})",
                            hint="tensors created per step and kept: look for lists that grow per step",
                            kind="live-tensors", step=step, dedup="live-tensors",
                            evidence={"counts": counts, "top": kinds})

    def reset(self) -> None:
        super().reset()
        self._series.clear()
        self._census.clear()

    def frame(self):
        import pandas as pd
        cols = ["step", "engine_bytes", "rss_anon_bytes", "swap_bytes", "host_bytes", "device_allocated_bytes",
                "retained_tensors", "retained_bytes", "live_tensors"]
        return pd.DataFrame(self.rows, columns=cols)
