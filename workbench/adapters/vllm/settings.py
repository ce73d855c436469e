"""The plugin's settings, read from the environment once per vLLM process, never raising.

A bad value must not stop vLLM (issue 26): each one becomes a `problem` (one log line naming
the variable, the value and what was used instead) and the default is kept.

  PAGEDKV_VLLM_SANITIZER     where findings go: tcp://127.0.0.1:PORT or ipc://PATH (the workbench
                             binds it). Set to anything, the plugin is on; an address we cannot use
                             keeps the checks on and sends their findings to vLLM's log only.
  PAGEDKV_VLLM_POOL_EVERY    run the (incremental) pool check every N engine steps   default 1
  PAGEDKV_VLLM_SWEEP_SLICE   blocks the pool check reads each step besides those the step touched,
                             a rotating slice: the whole pool is covered every num_blocks / N
                             steps (as often as the full sweep it replaces ran)   default 512
  PAGEDKV_VLLM_FULL_EVERY    also a full sweep of the pool on vLLM's thread every N pool checks
                             (its cost grows with the pool: ~29 ms at 100k blocks) default 0: off;
                             the full sweep runs when vLLM goes idle, on the plugin's own thread
  PAGEDKV_VLLM_INACTIVE_AFTER  a check that should have run and has not, for N steps
                             with work, is a `check-inactive` warning                 default 64
  PAGEDKV_VLLM_STALL_AFTER   a request not running and unscheduled for N steps while the pool
                             has room for it is `stalled`                             default 256
  PAGEDKV_VLLM_STALL_AFTER_S and for at least this many seconds (an idle engine steps fast)  default 10
  PAGEDKV_VLLM_ATTENTION     the attention check (attention_watch.py); 0 / off / false turns it
                             off: no layer's impl.forward is touched                  default on
  PAGEDKV_VLLM_CHECK_THREAD  the engine-core checks on their own thread, overlapping vLLM's forward
                             (aside.py); 0 / off / false runs them inline on vLLM's thread   default on
  PAGEDKV_VLLM_FAULT_FILE    a JSON file naming faults to plant (tests, notebooks; faults.py)
  PAGEDKV_RECORD             the flight recorder (recording.py), on with the plugin; 0 / off / false
                             turns it off                                             default on
  PAGEDKV_RECORD_DIR         where recordings go, one directory per engine core process
                                        default ~/.cache/pagedkv-workbench/recordings (XDG_CACHE_HOME)
  PAGEDKV_RECORD_MAX_MB      the ring's size cap per process, oldest segment out first    default 256
  PAGEDKV_RECORD_PRIVACY     1: prompt lengths and per-block digests, no token ids        default 0
  PAGEDKV_RECORD_KEEP        recordings (one per engine core start) kept under PAGEDKV_RECORD_DIR,
                             the oldest removed first                                 default 8
  PAGEDKV_RECORD_KEEP_MB     and at most this many MB in all (recordings and bundles)    default 2048
  PAGEDKV_RECORD_BUNDLES     repro bundles kept per recording, the oldest removed first   default 16
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import urlparse

ENV_SANITIZER = "PAGEDKV_VLLM_SANITIZER"
ENV_POOL_EVERY = "PAGEDKV_VLLM_POOL_EVERY"
ENV_FULL_EVERY = "PAGEDKV_VLLM_FULL_EVERY"
ENV_SWEEP_SLICE = "PAGEDKV_VLLM_SWEEP_SLICE"
ENV_INACTIVE_AFTER = "PAGEDKV_VLLM_INACTIVE_AFTER"
ENV_FAULT_FILE = "PAGEDKV_VLLM_FAULT_FILE"
ENV_ATTENTION = "PAGEDKV_VLLM_ATTENTION"
ENV_CHECK_THREAD = "PAGEDKV_VLLM_CHECK_THREAD"
ENV_STALL_AFTER = "PAGEDKV_VLLM_STALL_AFTER"
ENV_STALL_AFTER_S = "PAGEDKV_VLLM_STALL_AFTER_S"
ENV_RECORD = "PAGEDKV_RECORD"
ENV_RECORD_DIR = "PAGEDKV_RECORD_DIR"
ENV_RECORD_MAX_MB = "PAGEDKV_RECORD_MAX_MB"
ENV_RECORD_PRIVACY = "PAGEDKV_RECORD_PRIVACY"
ENV_RECORD_KEEP = "PAGEDKV_RECORD_KEEP"
ENV_RECORD_KEEP_MB = "PAGEDKV_RECORD_KEEP_MB"
ENV_RECORD_BUNDLES = "PAGEDKV_RECORD_BUNDLES"


@dataclass
class Settings:
    enabled: bool = False
    address: str | None = None            # None: findings go to vLLM's log only
    pool_every: int = 1
    full_every: int = 0                   # 0: no full sweep on vLLM's thread (slices, and the idle sweep)
    sweep_slice: int = 512
    inactive_after: int = 64
    stall_after: int = 256
    stall_after_s: int = 10
    fault_file: str | None = None
    attention: bool = True
    check_thread: bool = True             # the engine-core checks overlap the forward (aside.py)
    record_dir: str | None = None         # None: the flight recorder is off
    record_max_mb: int = 256
    record_privacy: bool = False
    record_keep: int = 8                  # recordings kept under record_dir
    record_keep_mb: int = 2048            # MB kept under record_dir in all
    record_bundles: int = 16              # bundles kept per recording
    problems: list[str] = field(default_factory=list)


def _whole(env, name: str, default: int, problems: list[str], low: int = 1) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw.strip())
    except ValueError:
        v = None
    if v is None or v < low:
        problems.append(f"{name}={raw!r} is not a whole number >= {low}; using {default}")
        return default
    return v


def address_problem(address: str) -> str | None:
    """Why a sanitizer address cannot be connected to, or None when it can."""
    if address.startswith("ipc://"):
        return None if len(address) > len("ipc://") else "ipc:// needs a path"
    u = urlparse(address)
    if u.scheme != "tcp":
        return "give tcp://127.0.0.1:PORT or ipc://PATH"
    try:
        port = u.port
    except ValueError:
        port = None
    if port is None or not u.hostname:
        return "a tcp:// address needs a host and a port (tcp://127.0.0.1:PORT)"
    return None


def read(env=None) -> Settings:
    env = os.environ if env is None else env
    raw = env.get(ENV_SANITIZER)
    s = Settings()
    if not raw:
        return s                                    # off by default
    s.enabled = True
    why = address_problem(raw.strip())
    if why is None:
        s.address = raw.strip()
    else:
        s.problems.append(f"{ENV_SANITIZER}={raw!r} is not an address the plugin can send to ({why}); the checks "
                          f"run and their findings go to vLLM's log only")
    s.pool_every = _whole(env, ENV_POOL_EVERY, 1, s.problems)
    s.full_every = _whole(env, ENV_FULL_EVERY, 0, s.problems, low=0)
    s.sweep_slice = _whole(env, ENV_SWEEP_SLICE, 512, s.problems, low=0)
    s.inactive_after = _whole(env, ENV_INACTIVE_AFTER, 64, s.problems)
    s.stall_after = _whole(env, ENV_STALL_AFTER, 256, s.problems)
    s.stall_after_s = _whole(env, ENV_STALL_AFTER_S, 10, s.problems, low=0)
    s.fault_file = env.get(ENV_FAULT_FILE) or None
    s.attention = str(env.get(ENV_ATTENTION, "1")).strip().lower() not in ("0", "off", "false", "no")
    s.check_thread = str(env.get(ENV_CHECK_THREAD, "1")).strip().lower() not in ("0", "off", "false", "no")
    if str(env.get(ENV_RECORD, "1")).strip().lower() not in ("0", "off", "false", "no"):
        cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        s.record_dir = env.get(ENV_RECORD_DIR) or os.path.join(cache, "pagedkv-workbench", "recordings")
    s.record_max_mb = _whole(env, ENV_RECORD_MAX_MB, 256, s.problems)
    s.record_privacy = str(env.get(ENV_RECORD_PRIVACY, "0")).strip().lower() in ("1", "on", "true", "yes")
    s.record_keep = _whole(env, ENV_RECORD_KEEP, 8, s.problems)
    s.record_keep_mb = _whole(env, ENV_RECORD_KEEP_MB, 2048, s.problems)
    s.record_bundles = _whole(env, ENV_RECORD_BUNDLES, 16, s.problems)
    return s
