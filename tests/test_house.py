"""The house rules a newcomer can rely on, checked on the source itself."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "workbench" / "engine"


def _lines(path):
    return [ln.strip() for ln in path.read_text().splitlines()
            if ln.strip() and not ln.strip().startswith(("#", '"""', "from ", "import "))]


def test_engine_and_simulator_share_no_block_of_six_lines():
    a, b = _lines(ENGINE / "engine.py"), _lines(ROOT / "workbench" / "trace" / "simulate.py")
    windows = {tuple(a[i:i + 6]) for i in range(len(a) - 5)}
    shared = [b[i:i + 6] for i in range(len(b) - 5) if tuple(b[i:i + 6]) in windows]
    assert not shared, "engine.py and simulate.py repeat:\n" + "\n".join(shared[0])


def test_no_engine_code_detects_a_monkeypatch():
    # Faults change behaviour through seams (page_reader, fuse_rope_write, repage), never by
    # the engine looking at what was patched.
    bad = re.compile(r"\bvars\(self\)|in vars\(|type\(\w+\)\.\w+ is \w+\.\w+")
    hits = [f"{p.relative_to(ROOT)}:{i}: {ln.strip()}" for p in ENGINE.rglob("*.py")
            for i, ln in enumerate(p.read_text().splitlines(), 1) if bad.search(ln)]
    assert not hits, "\n".join(hits)
