"""The bandwidth probe's learned baselines: steps bucketed by batch shape, and the JSON store of
the GB/s clean steps of each bucket reached on this machine for this model (baselines.json).

Split from probes/bandwidth.py (the probe, its verdicts and the host-load excuses), which
re-exports these names.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import threading
import time
import warnings
from pathlib import Path

from workbench.events import StepFinished

BASELINE_FILE = "baselines.json"
BASELINE_FORMAT = "pagedkv-workbench bandwidth baselines"
BASELINE_VERSION = 1


# ---- batch-shape buckets ------------------------------------------------------------
def _count_index(n: int) -> int:
    """Power-of-two bucket of a count: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
    return max(0, int(n) - 1).bit_length()


def _count_label(i: int) -> str:
    return "1" if i == 0 else "2" if i == 1 else f"{(1 << (i - 1)) + 1}-{1 << i}"


def _bytes_index(b: int) -> int:
    """Power-of-two bucket of a byte count: 0 -> -1, [2^k, 2^(k+1)) -> k."""
    return int(b).bit_length() - 1 if b > 0 else -1


def _fmt_pow2(k: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if k >= shift:
            return f"{1 << (k - shift)}{unit}"
    return f"{1 << k}B"


def _bytes_label(k: int) -> str:
    return "0" if k < 0 else f"{_fmt_pow2(k)}-{_fmt_pow2(k + 1)}"


def bucket_label(decode_only: bool, seqs_i: int, kv_i: int, tokens_i: int | None = None) -> str:
    """e.g. 'decode|seqs=3-4|kv=16MiB-32MiB', 'mixed|seqs=2|tokens=513-1024|kv=0'."""
    if decode_only:
        return f"decode|seqs={_count_label(seqs_i)}|kv={_bytes_label(kv_i)}"
    return f"mixed|seqs={_count_label(seqs_i)}|tokens={_count_label(tokens_i or 0)}|kv={_bytes_label(kv_i)}"


def step_bucket(e: StepFinished) -> tuple[str, list[str]]:
    """The step's batch-shape bucket and its neighbours (the next KV bucket down, then up)."""
    decode_only = e.num_prefill_tokens == 0
    s_i, kv_i = _count_index(e.num_seqs), _bytes_index(e.bytes_kv_read)
    t_i = None if decode_only else _count_index(e.num_tokens)
    near = [bucket_label(decode_only, s_i, k, t_i) for k in (kv_i - 1, kv_i + 1) if k >= -1]
    return bucket_label(decode_only, s_i, kv_i, t_i), near


def model_identity(engine) -> tuple[str, str]:
    """(fingerprint, description) of what sets a step's speed: architecture, dtype, KV dtype,
    weight bytes. Not the weights' values (a fine-tune runs as fast), not the file's path."""
    mc = engine.model_config
    arch = {k: v for k, v in dataclasses.asdict(mc).items() if k not in ("bos_token_id", "eos_token_ids")}
    ident = {"config": arch, "dtype": str(engine.dtype), "kv_dtype": str(engine.kv_dtype),
             "kv_scaled": bool(getattr(engine, "kv_scaled", False)),
             "weight_bytes": int(getattr(engine, "weight_bytes", 0))}
    fp = hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    name = Path(str(getattr(engine, "source", "") or "model")).name
    desc = (f"{name}: {mc.architecture} {mc.num_layers} layers, hidden {mc.hidden_size}, "
            f"{str(engine.dtype).removeprefix('torch.')}, KV {str(engine.kv_dtype).removeprefix('torch.')}"
            + (" scaled" if ident["kv_scaled"] else ""))
    return fp, desc


def _quantile(xs: list[float], q: float) -> float:
    v = sorted(xs)
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


_NOW = [None, ""]                # (the second, its ISO text): learn() stamps every step, ~5 us a format


def _now() -> str:
    sec = int(time.time())
    if _NOW[0] != sec:
        _NOW[1] = _dt.datetime.fromtimestamp(sec, _dt.timezone.utc).isoformat(timespec="seconds")
        _NOW[0] = sec
    return _NOW[1]


# ---- the baseline store -----------------------------------------------------------------
_STORE_LOCK = threading.Lock()


class BaselineStore:
    """GB/s that clean steps of each batch shape reached on this machine: baselines.json.

    JSON (never pickle), written atomically:
        {"format": "pagedkv-workbench bandwidth baselines", "version": 1,
         "baselines": {"<machine>||<model fingerprint>||<bucket>": {
             "machine": "vm|cpu Intel(R) Xeon(R) ...|torch 2.13.0+cpu|threads 1",
             "model": "<fingerprint>", "model_desc": "...", "bucket": "decode|seqs=3-4|kv=16MiB-32MiB",
             "gbs_samples": [...],          # the last max_samples clean steps, oldest first
             "gbs_baseline": 8.9,           # their quantile, for a reader (recomputed on load)
             "n": 123,                      # clean steps learned in all
             "page_size": 16, "attention_backend": "cpu", "updated_at": "2026-12-01T08:00:00+00:00"}}}
    A file that is not JSON, not this format, or a newer version is ignored with a warning
    naming it (and replaced at the next save); a malformed entry is dropped the same way.
    path None: in memory only.
    """

    def __init__(self, path: str | Path | None, max_samples: int = 64, max_entries: int = 4096,
                 quantile: float = 0.75):
        self.path = Path(path) if path else None
        self.max_samples = max_samples
        self.max_entries = max_entries
        self.quantile = quantile
        self.entries: dict[str, dict] = {}
        self._new: dict[str, list[float]] = {}          # learned since the last save
        self.warnings: list[str] = []
        if self.path is not None:
            self.entries = self._read()

    @staticmethod
    def key(machine: str, model: str, bucket: str) -> str:
        return f"{machine}||{model}||{bucket}"

    def _warn(self, msg: str, quiet: bool = False) -> None:
        if quiet:
            return
        self.warnings.append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _read(self, quiet: bool = False) -> dict[str, dict]:
        path = self.path
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:
            self._warn(f"{path}: cannot be read ({e}); bandwidth baselines start empty", quiet)
            return {}
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError as e:                     # not UTF-8 (a pickle, say) or not JSON
            self._warn(f"{path}: not JSON ({e}); ignoring it: bandwidth baselines start empty "
                       f"and the file is replaced at the next save", quiet)
            return {}
        if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT:
            self._warn(f"{path}: not a bandwidth baseline file (no \"format\": \"{BASELINE_FORMAT}\"); "
                       f"ignoring it: baselines start empty and the file is replaced at the next save", quiet)
            return {}
        if data.get("version") != BASELINE_VERSION or not isinstance(data.get("baselines"), dict):
            self._warn(f"{path}: baseline file version {data.get('version')!r}, this code reads "
                       f"{BASELINE_VERSION}; ignoring it: baselines start empty", quiet)
            return {}
        out, bad = {}, 0
        for k, ent in data["baselines"].items():
            samples = ent.get("gbs_samples") if isinstance(ent, dict) else None
            if (isinstance(samples, list) and samples
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                            for x in samples)
                    and isinstance(ent.get("bucket"), str)):
                out[k] = {**ent, "gbs_samples": [float(x) for x in samples][-self.max_samples:]}
            else:
                bad += 1
        if bad:
            self._warn(f"{path}: {bad} malformed baseline entr{'y' if bad == 1 else 'ies'} ignored", quiet)
        return out

    def baseline(self, key: str, min_samples: int = 1) -> dict | None:
        """The entry with its baseline GB/s under "gbs_baseline", or None with < min_samples."""
        ent = self.entries.get(key)
        if ent is None or len(ent["gbs_samples"]) < min_samples:
            return None
        ent["gbs_baseline"] = _quantile(ent["gbs_samples"], self.quantile)
        return ent

    def learn(self, key: str, gbs: float, **meta) -> None:
        ent = self.entries.get(key)
        if ent is None:
            ent = self.entries[key] = {"gbs_samples": [], "n": 0, **meta}
        ent.update(meta)
        ent["gbs_samples"] = (ent["gbs_samples"] + [float(gbs)])[-self.max_samples:]
        ent["n"] = int(ent.get("n", 0)) + 1
        ent["updated_at"] = _now()
        self._new.setdefault(key, []).append(float(gbs))

    @property
    def unsaved(self) -> int:
        return sum(len(v) for v in self._new.values())

    def save(self) -> Path | None:
        """Merge what was learned since the last save into the file (re-read first: another
        process may have saved meanwhile) and write it. Returns the path, None if nothing to do."""
        if self.path is None or not self._new:
            return None
        with _STORE_LOCK:
            on_disk = self._read(quiet=True)           # warned once, at load
            for key, new in self._new.items():
                mine = self.entries.get(key, {})
                ent = dict(on_disk.get(key) or {})
                base = ent.get("gbs_samples", [])
                meta = {k: v for k, v in mine.items() if k not in ("gbs_samples", "n", "gbs_baseline")}
                ent.update(meta)
                ent["gbs_samples"] = (base + new)[-self.max_samples:]
                ent["n"] = int(ent.get("n", 0)) + len(new)
                ent["gbs_baseline"] = _quantile(ent["gbs_samples"], self.quantile)
                on_disk[key] = ent
            if len(on_disk) > self.max_entries:             # a cache must not grow without end
                keep = sorted(on_disk, key=lambda k: str(on_disk[k].get("updated_at", "")))[-self.max_entries:]
                on_disk = {k: on_disk[k] for k in keep}
            from workbench.engine.peaks import _write_cache
            try:
                _write_cache(self.path, {"format": BASELINE_FORMAT, "version": BASELINE_VERSION,
                                         "baselines": on_disk})
            except OSError as e:                    # a read-only cache: keep them in memory
                self._warn(f"{self.path}: cannot be written ({e}); bandwidth baselines kept in memory only")
                return None
            self.entries = on_disk
            self._new.clear()
            return self.path
