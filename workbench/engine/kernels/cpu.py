"""The instruction-set features of this CPU: what a -march=native build may use.

A build compiled with -march=native on one CPU uses every vector extension that CPU has; loaded
on a CPU without one of them (an AVX-512 build on an AVX2-only host sharing the cache) it dies
with SIGILL at the first such instruction, not with an error we can catch. So every build's
manifest records the features it was compiled for, and the loader compares them with these.
"""
from __future__ import annotations

import functools
import platform
import re
import subprocess

from .. import env

# Only the flags that change what a compiler may emit: /proc/cpuinfo also lists bugs, power
# management and virtualisation flags, which differ between identical CPUs and would make
# every host look different.
ISA = re.compile(r"^(sse\w*|pni|ssse3|avx\w*|amx\w*|fma\w*|f16c|bmi\d|popcnt|movbe|adx|aes|vaes|vpclmulqdq|pclmulqdq"
                 r"|gfni|sha_ni|lzcnt|abm|asimd\w*|sve\w*|fp16|bf16|i8mm|neon)$")
OVERRIDE = "PAGEDKV_CPU_FEATURES"     # comma- or space-separated: tests fake another CPU with it
NONE = "none"                         # PAGEDKV_CPU_FEATURES=none: a CPU with no features, no compiled code
MACHINE = "PAGEDKV_MACHINE"           # fakes platform.machine() for the loader (tests: aarch64)
X86 = ("x86_64", "amd64", "i386", "i686")


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
        return frozenset(x for x in re.split(r"[,\s]+", text.lower()) if x and x != NONE)
    return _read()


# the compiler's predefined macros for a -march target, as /proc/cpuinfo names the features
MACROS = {"__SSE__": "sse", "__SSE2__": "sse2", "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1",
          "__SSE4_2__": "sse4_2", "__POPCNT__": "popcnt", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
          "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2", "__LZCNT__": "abm", "__MOVBE__": "movbe",
          "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl",
          "__AVX512CD__": "avx512cd", "__AVX512BF16__": "avx512_bf16", "__AVX512VNNI__": "avx512_vnni",
          "__AVX512FP16__": "avx512_fp16", "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16",
          "__AMX_INT8__": "amx_int8", "__AVXVNNI__": "avx_vnni"}


@functools.lru_cache(maxsize=None)
def target_features(march: str, compiler: tuple[str, ...]) -> frozenset[str]:
    """The features a build with -march=`march` may use, from the compiler's own predefined macros (a
    PAGEDKV_MARCH build: x86-64-v3 is AVX2 + FMA, loadable on any such CPU). Raises when the compiler
    does not know the target."""
    done = subprocess.run([*compiler, f"-march={march}", "-dM", "-E", "-x", "c", "-"], input="",
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler[0]} -march={march}: {(done.stderr or '').strip()[-200:]}")
    names = {ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("#define ")}
    return frozenset(MACROS[m] for m in names if m in MACROS)


def faked_text() -> str | None:
    """$PAGEDKV_CPU_FEATURES as set (the faked CPU), None where the real CPU is read."""
    return env.value(OVERRIDE)


def no_compiled_code() -> bool:
    """PAGEDKV_CPU_FEATURES=none: a CPU that runs no compiled kernel of ours, not even the portable C loops."""
    text = faked_text()
    return text is not None and not cpu_features(text)


def real_machine() -> str:
    """What the compiler here builds for: platform.machine(), lower case."""
    return platform.machine().lower() or "unknown"


def machine() -> str:
    """The machine the loader believes it runs on: $PAGEDKV_MACHINE where set (a faked aarch64), else
    real_machine()."""
    return (env.value(MACHINE) or real_machine()).lower()


def is_x86(name: str | None = None) -> bool:
    return (machine() if name is None else name) in X86


# the features that decide which kernels can run: shown first (of ~40 flags)
SHOWN_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")


def listed(features, most: int = 6) -> str:
    """Features for a message: all of them when few, else the deciding ones and how many more."""
    names = sorted(features)
    if len(names) <= most:
        return ", ".join(names)
    key = [f for f in names if f in SHOWN_FEATURES] or names[:most]
    return f"{', '.join(key)} and {len(names) - len(key)} more"


def missing(built_for, have=None) -> list[str]:
    """The features a build was compiled for that this CPU (or `have`) lacks, sorted."""
    have = cpu_features() if have is None else have
    return sorted(set(built_for) - set(have))
