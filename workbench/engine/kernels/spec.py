"""What one native extension is: its sources, how it is compiled, and the switch that turns it off."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

CSRC = Path(__file__).parents[1] / "csrc"              # engine/csrc: the shared headers and the C loops
ATTENTION_CSRC = Path(__file__).parents[1] / "attention" / "csrc"


@dataclass(frozen=True)
class Spec:
    name: str                       # the module name (PyInit_<name> / TORCH_EXTENSION_NAME)
    sources: tuple[Path, ...]
    what: str                       # for messages: "compiled CPU attention"
    kind: str = "torch"             # "torch": C++ through torch.utils.cpp_extension; "c": a plain CPython module
    flags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    headers: tuple[Path, ...] = field(default_factory=lambda: tuple(sorted(CSRC.glob("*.h"))))
    # the env var (and value) that keeps the Python / torch path process-wide (engine/env.py's table)
    switch: tuple[str, str] | None = None
    # the machines the sources are written for (x86 intrinsics, x86-only compiler flags); None: portable
    machines: tuple[str, ...] | None = None

    @property
    def march(self) -> str | None:
        """The -march (or -mcpu) target the flags give, None for a portable build."""
        return next((f.split("=", 1)[1] for f in self.flags if f.startswith(("-march=", "-mcpu="))), None)

    @property
    def for_this_cpu(self) -> bool:
        """Whether the build uses this CPU's instruction set (-march=native): then its manifest lists
        the CPU's features and a CPU without one of them must not load it."""
        return self.march == "native"

    def targeting(self, march: str | None) -> "Spec":
        """This spec compiled for another -march (PAGEDKV_MARCH): native flags replaced, a separate cache entry."""
        if not march or march == "native" or not self.for_this_cpu:
            return self
        return replace(self, flags=tuple(f"-march={march}" if f in ("-march=native", "-mcpu=native") else f
                                         for f in self.flags))

    def source_hash(self) -> str:
        """sha256 over the sources and the headers they may include: the compilers' own caches
        (torch's ninja) track sources, not headers, so a header edit must change the key."""
        h = hashlib.sha256()
        for p in (*self.sources, *sorted(self.headers)):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        return h.hexdigest()
