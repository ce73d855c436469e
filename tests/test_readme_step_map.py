"""The docs' map of a step (docs/design/step-map.md) names files and functions that exist: a map kept true.

Every backticked path in the "One step, file by file" table must exist under workbench/, and every
backticked name in the same cell must be defined in the file named before it (a class, function or
method definition, not just any mention)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table_rows():
    text = (ROOT / "docs" / "design" / "step-map.md").read_text()
    start = text.index("# One step, file by file")
    end = text.find("\n#", start + 5)
    end = len(text) if end < 0 else end
    return [line for line in text[start:end].splitlines() if line.startswith("| ") and line[2].isdigit()]


def test_every_file_and_name_in_the_step_map_exists():
    rows = table_rows()
    assert len(rows) >= 8
    for row in rows:
        where = row.rsplit("|", 2)[-2]
        current = None
        for tok in re.findall(r"`([^`]+)`", where):
            for name in re.split(r"[ ,()]+", tok):
                if not name or name in ("->",):
                    continue
                if "/" in name or name.endswith(".py"):
                    path = ROOT / "workbench" / name.rstrip("/")
                    if not path.exists():
                        path = ROOT / name.rstrip("/")
                    assert path.exists(), (row, name)
                    current = path if path.is_file() else None
                elif current is not None and name[0].isalpha():
                    last = name.split(".")[-1]
                    src = current.read_text()
                    assert re.search(rf"^\s*(class|def) {re.escape(last)}\b", src, re.M), (row, name, current)
