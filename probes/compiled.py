"""The probes' compiled clean paths (probes/csrc/), in one list: what `make` builds at setup, what
`kvwb doctor` reports and what PAGEDKV_PROBE_KERNELS=numpy switches off. Each is tried once per
process against the numpy code it stands in for, and numpy runs wherever it is refused."""
from __future__ import annotations


def kernels() -> tuple:
    """(the attention check, the page_table checks, the page write ledger's step, the packing checks):
    workbench Kernels."""
    from .attention_native import CHECK
    from .packing_native import CHECK as PACKING
    from .page_table_native import CHECKS
    from .page_writes_native import STEP
    return CHECK, CHECKS, STEP, PACKING


def main() -> None:
    """Build (or load) each and say what runs: `make` calls this after the engine's kernels."""
    for k in kernels():
        print(f"{k.spec.what}:", "ready" if k.get() is not None else f"unavailable ({k.why()}), {k.fallback} will run")
