"""`make lab` as a new user runs it: JupyterLab comes up on 127.0.0.1 with the project's kernel,
serving the start-here notebook (which test_notebooks.py executes top to bottom)."""
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOKEN = "kvwb-make-lab-test"

pytestmark = [pytest.mark.ui, pytest.mark.timeout(300)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str):
    with urllib.request.urlopen(f"{url}?token={TOKEN}", timeout=10) as r:
        return r.status, json.loads(r.read())


def test_make_lab_serves_the_start_here_notebook(tmp_path):
    port = free_port()
    log = tmp_path / "lab.log"
    env = dict(os.environ, JUPYTER_TOKEN=TOKEN, BROWSER="true")       # BROWSER=true: open nothing
    with open(log, "w") as out:
        proc = subprocess.Popen(["make", "lab", f"LAB_PORT={port}"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                get(f"{base}/api/status")
                break
            except OSError:
                assert proc.poll() is None, f"make lab exited {proc.returncode}:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"JupyterLab did not come up:\n{log.read_text()[-3000:]}"
                time.sleep(1)
        # given a file, JupyterLab serves that file's folder (notebooks/) and opens the file
        status, nb = get(f"{base}/api/contents/00_start_here.ipynb")
        assert status == 200 and nb["type"] == "notebook"
        assert any(c["cell_type"] == "code" for c in nb["content"]["cells"])
        _, specs = get(f"{base}/api/kernelspecs")
        assert "pagedkv-workbench" in specs["kernelspecs"]              # make lab installed the kernel
        text = log.read_text()
        assert f"127.0.0.1:{port}" in text and "0.0.0.0" not in text    # loopback only
        assert "00_start_here.ipynb" in text                             # opened on the start-here notebook
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
