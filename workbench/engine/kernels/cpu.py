"""The instruction-set features of this CPU: what a -march=native build may use.

A build compiled with -march=native on one CPU uses every vector extension that CPU has; loaded
on a CPU without one of them (an AVX-512 build on an AVX2-only host sharing the cache) it dies
with SIGILL at the first such instruction, not with an error we can catch. So every build's
manifest records the features it was compiled for, and the loader compares them with these.
"""
from __future__ import annotations

import functools
import re

from .. import env

# Only the flags that change what a compiler may emit: /proc/cpuinfo also lists bugs, power
# management and virtualisation flags, which differ between identical CPUs and would make
# every host look different.
ISA = re.compile(r"^(sse\w*|ssse3|avx\w*|amx\w*|fma\w*|f16c|bmi\d|popcnt|movbe|adx|aes|vaes|vpclmulqdq|pclmulqdq"
                 r"|gfni|sha_ni|lzcnt|abm|asimd\w*|sve\w*|fp16|bf16|i8mm|neon)$")
OVERRIDE = "PAGEDKV_CPU_FEATURES"     # comma- or space-separated: tests fake another CPU with it


@functools.lru_cache(maxsize=None)
def _read(path: str = "/proc/cpuinfo") -> frozenset[str]:
    try:
        with open(path) as f:
            for line in f:
                # x86 says "flags", arm64 "Features"; the first processor stands for all of them
                if line.split(":")[0].strip() in ("flags", "Features"):
                    return frozenset(x for x in line.split(":", 1)[1].split() if ISA.match(x))
    except OSError:
        pass
    return frozenset()


def cpu_features(override: str | None = None) -> frozenset[str]:
    """This CPU's ISA features (avx2, avx512f, avx512_bf16, amx_tile, ...).

    `override` (or $PAGEDKV_CPU_FEATURES, through engine/env.py) replaces what
    /proc/cpuinfo says: a test can be "a CPU without AVX-512" on any machine."""
    text = override if override is not None else env.value(OVERRIDE)
    if text is not None:
        return frozenset(x for x in re.split(r"[,\s]+", text) if x)
    return _read()


def missing(built_for, have=None) -> list[str]:
    """The features a build was compiled for that this CPU (or `have`) lacks, sorted."""
    have = cpu_features() if have is None else have
    return sorted(set(built_for) - set(have))
