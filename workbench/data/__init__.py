"""Small data shipped with the workbench (the Mooncake trace excerpt)."""
from importlib import resources
from pathlib import Path


def mooncake_excerpt() -> Path:
    """The first 400 requests of the Mooncake conversation trace (Apache-2.0; see the .SOURCE.txt beside it)."""
    return Path(str(resources.files(__package__) / "mooncake_conversation_excerpt.jsonl"))


def mooncake_full() -> Path | None:
    """The whole trace when this checkout sits beside ../shared/traces; None elsewhere."""
    p = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_fast25_conversation" / "conversation_trace.jsonl"
    return p if p.exists() else None
