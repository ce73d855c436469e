"""The recorder on a disk: earlier recordings and bundles kept within a budget (oldest out first), and a
full disk that drops records (counted, one log line) and is written again once space returns."""
from __future__ import annotations

import json
import logging
import os

from workbench.recorder.budget import enforce, trim_bundles
from workbench.recorder.bundle import BUNDLES, freeze
from workbench.recorder.ring import SegmentRing


def run_dir(root, name, mb=0.0, bundles=0, t=0.0):
    d = root / name
    d.mkdir(parents=True)
    (d / "seg-000001.jsonl").write_bytes(b"x" * int(mb * 2**20) or b"{}\n")
    for i in range(bundles):
        b = d / BUNDLES / f"b{i:03d}"
        b.mkdir(parents=True)
        (b / "seg-000001.jsonl").write_bytes(b"{}\n")
        os.utime(b, (t + i, t + i))
    os.utime(d, (t, t))
    return d


def test_earlier_recordings_and_bundles_are_kept_within_the_budget(tmp_path):
    runs = [run_dir(tmp_path, f"vllm-{i}", mb=1.0, bundles=3, t=1000 + 100 * i) for i in range(6)]
    (tmp_path / "notes.txt").write_text("not a recording")            # never touched
    cur = runs[-1]
    t = enforce(tmp_path, current=cur, keep_runs=3, keep_bytes=64 * 2**20, keep_bundles=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "vllm-3", "vllm-4", "vllm-5"]
    assert [os.path.basename(r) for r in t.runs] == ["vllm-0", "vllm-1", "vllm-2"]     # oldest first
    for r in runs[3:]:
        assert sorted(b.name for b in (r / BUNDLES).iterdir()) == ["b001", "b002"]     # newest two kept
    # bytes: 2.5 MB allowed, three runs of ~1 MB: the oldest earlier run goes, never the current one
    t = enforce(tmp_path, current=cur, keep_runs=8, keep_bytes=int(2.5 * 2**20), keep_bundles=8)
    assert [os.path.basename(r) for r in t.runs] == ["vllm-3"] and cur.exists() and (cur / "seg-000001.jsonl").exists()
    assert t.freed_bytes >= 2**20 and trim_bundles(cur, 0).bundles and not list((cur / BUNDLES).iterdir())


def test_a_full_disk_drops_records_counts_them_says_so_once_and_resumes(tmp_path, monkeypatch, caplog):
    ring = SegmentRing(tmp_path / "rec", {"writer": "test"}, max_bytes=1 << 20, flush_s=1e9)
    ring.write({"k": "a"})
    ring.flush()
    real_open = open
    full = {"on": True}

    def fake_open(path, *a, **k):
        if full["on"] and str(path).startswith(str(tmp_path / "rec")):
            raise OSError(28, "No space left on device")
        return real_open(path, *a, **k)

    # the disk fills: the open segment fails on write, the next one on open
    class FailingFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            self.f.close()

    ring._f = FailingFile(ring._f)
    monkeypatch.setattr("builtins.open", fake_open)
    caplog.set_level(logging.WARNING, logger="workbench.recorder")
    for i in range(5):
        ring.write({"k": "lost", "i": i})
        ring.flush()                                   # never raises
    assert ring.records_dropped == 5 and ring.disk_full and ring.write_errors == 5
    said = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(said) == 1                              # one log line for the whole episode
    full["on"] = False                                 # space returns
    ring.write({"k": "back"})
    ring.flush()
    assert not ring.disk_full
    lines = [json.loads(x) for p in sorted((tmp_path / "rec").glob("seg-*.jsonl")) for x in p.read_text().splitlines()]
    assert [x["k"] for x in lines if x["k"] != "header"] == ["a", "back"]       # no torn line, nothing made up
    assert freeze(ring, "after").exists()


def test_the_vllm_recorders_run_never_holds_more_bundles_than_its_budget(tmp_path, monkeypatch):
    """The plugin's recorder makes room before a bundle appears, so a process that ends between a freeze and the
    budget (the freezer is a daemon thread: a SIGUSR1 burst at the very end) leaves no more than the budget. The
    budget after the freeze is taken away here, as such an end would; three freezes leave two bundles."""
    from workbench.adapters.vllm.recording import VllmRecorder
    from workbench.adapters.vllm.settings import Settings
    rec = VllmRecorder(Settings(record_dir=str(tmp_path), record_bundles=2))
    rec.ring = SegmentRing(tmp_path / "vllm-1", {"engine": "vllm"})
    monkeypatch.setattr(VllmRecorder, "_budget", lambda self: None)          # the process gone before it ran
    made = []
    for i in range(3):
        rec.ring.write({"k": "step", "step": i})
        made.append(rec.freeze(f"SIGUSR1-{i}"))
        left = [b for b in (tmp_path / "vllm-1" / BUNDLES).iterdir() if not b.name.startswith(".")]
        assert len(left) <= 2, [b.name for b in left]
    assert all(made) and {str(b) for b in left} == set(made[1:])             # the oldest went, the newest stayed
    rec.close()
