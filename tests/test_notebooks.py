"""The notebooks are the front door, and each is its own source.

Every notebooks/<name>.ipynb is paired by jupytext (notebooks/jupytext.toml) with a percent-format
notebooks/<name>.py, the file a diff, a review and a linter read: the two must hold the same cells.
Notebooks ship without outputs, and each runs top to bottom in a fresh kernel (marker `ui`).
"""
import difflib
import queue
from itertools import zip_longest
from pathlib import Path

import nbformat
import pytest

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
SYNC = ".venv/bin/jupytext --sync notebooks/{name}"


def test_the_notebooks_are_there():
    names = {p.stem for p in NOTEBOOKS}
    assert "00_start_here" in names and len(names) >= 13, sorted(names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} cell {i} carries outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_opens_on_the_projects_kernel(path):
    # the kernel `make lab` installs (Makefile KERNEL_NAME): JupyterLab opens the notebook on it, with
    # no "Select Kernel" dialog; the tests still run each on this interpreter (kernel_name="python3")
    spec = nbformat.read(path, as_version=4).metadata.get("kernelspec")
    assert spec == {"display_name": "PagedKV Workbench", "language": "python", "name": "pagedkv-workbench"}, \
        f"{path.name} kernelspec {spec!r}"
    make = (NB_DIR.parent / "Makefile").read_text()
    assert "KERNEL_NAME   := pagedkv-workbench" in make and '--display-name "PagedKV Workbench"' in make


def test_jupytext_toml_pairs_every_notebook_with_a_percent_py():
    from jupytext.config import find_jupytext_configuration_file, load_jupytext_configuration_file
    from jupytext.formats import long_form_multiple_formats
    found = find_jupytext_configuration_file(str(NB_DIR), search_parent_dirs=False)
    assert found and Path(found) == NB_DIR / "jupytext.toml", f"no jupytext.toml in notebooks/ (found {found})"
    config = load_jupytext_configuration_file(found)
    for path in NOTEBOOKS:
        formats = long_form_multiple_formats(config.default_formats(str(path)))
        assert {(f["extension"], f.get("format_name")) for f in formats} == {(".ipynb", None), (".py", "percent")}, \
            f"jupytext.toml pairs {path.name} as {formats}, not ipynb,py:percent"
        own = nbformat.read(path, as_version=4).metadata.get("jupytext", {}).get("formats")
        assert own is None, f"{path.name} sets its own jupytext formats {own!r}: the pairing lives in jupytext.toml"
    orphans = sorted(p.name for p in NB_DIR.glob("*.py") if not p.with_suffix(".ipynb").exists())
    assert not orphans, f"notebooks/{orphans} have no .ipynb: create it with `.venv/bin/jupytext --to ipynb`"


def cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_and_its_py_hold_the_same_cells(path):
    import jupytext
    py = path.with_suffix(".py")
    assert py.exists(), f"{path.name} has no paired {py.name}: run `{SYNC.format(name=path.name)}`"
    text = py.read_text(encoding="utf-8")
    compile(text, str(py), "exec")                       # the .py is plain Python (a SyntaxError says where)
    ipynb_cells, py_cells = cells(jupytext.read(path)), cells(jupytext.reads(text, fmt="py:percent"))
    for i, (a, b) in enumerate(zip_longest(ipynb_cells, py_cells)):
        if a == b:
            continue
        if a is None or b is None:
            where = f"{py.name} has {len(py_cells)} cells, {path.name} {len(ipynb_cells)}"
        elif a[0] != b[0]:
            where = f"a {a[0]} cell in {path.name}, a {b[0]} cell in {py.name}"
        else:
            where = "\n".join(difflib.unified_diff(a[1].splitlines(), b[1].splitlines(), path.name, py.name,
                                                   lineterm="", n=1))
        pytest.fail(f"{path.name} and {py.name} are out of sync at cell {i}:\n{where}\n"
                    f"`{SYNC.format(name=path.name)}` copies the newer file's cells into the other "
                    "(JupyterLab does it on save)")


# What every notebook imports first (torch, pandas, plotly, the workbench, the widgets): a kernel loads them
# while the notebook before it runs, so the ~2 s start and ~2-3 s of imports a notebook waited for overlap
# with work on the other core. plotly's renderers too, which its first figure shown imports: they import
# nbformat, whose jsonschema builds a URI grammar at import (~1.1 s here). Nothing is bound in the
# notebook's namespace: it still imports what it uses, and a missing import still fails it.
WARM_UP = """
import importlib as _importlib
for _name in ("torch", "numpy", "pandas", "plotly.express", "plotly.graph_objects", "plotly.subplots",
              "plotly.io._renderers", "ipywidgets", "workbench", "workbench.lab", "workbench.trace",
              "workbench.faults", "workbench.widgets", "probes"):
    _importlib.import_module(_name)
del _importlib, _name
"""


class WarmKernels:
    """Fresh kernels (this interpreter, started in notebooks/), each started one notebook ahead.

    Each notebook still gets a process of its own that ran no cell of any notebook; only the
    module imports above ran in it, silently."""

    def __init__(self):
        self._next = None

    def _start(self):
        from jupyter_client import KernelManager
        km = KernelManager(kernel_name="python3", client_class="jupyter_client.asynchronous.AsyncKernelClient")
        km.start_kernel(cwd=str(NB_DIR))
        from jupyter_client import BlockingKernelClient
        kc = BlockingKernelClient(**km.get_connection_info(session=True))
        kc.start_channels()
        msg_id = kc.execute(WARM_UP, silent=True, store_history=False)     # queued until the kernel is up
        return km, kc, msg_id

    def prepare(self):
        if self._next is None:
            self._next = self._start()

    def take(self, ahead: bool = True):
        """A warm kernel; ahead: start the next one (no notebook follows the last)."""
        km, kc, msg_id = self._next or self._start()
        self._next = self._start() if ahead else None               # boots while this notebook runs
        try:
            while True:                                             # the warm-up done (or failed: the
                try:                                                # notebook's own imports will say why)
                    reply = kc.get_shell_msg(timeout=120)
                except queue.Empty:
                    alive = km.is_alive()
                    self.stop(km)
                    raise RuntimeError(f"a kernel started in {NB_DIR} did not answer within 120 s "
                                       f"(its process {'was running' if alive else 'had exited'})") from None
                if reply["parent_header"].get("msg_id") == msg_id:
                    break
        finally:
            kc.stop_channels()
        return km

    @staticmethod
    def stop(km):
        km.shutdown_kernel(now=True)

    def close(self):
        if self._next is not None:
            self._next[1].stop_channels()
            self.stop(self._next[0])
            self._next = None


@pytest.fixture(scope="module", autouse=True)
def warm_kernels():
    # autouse: the first kernel boots while this module's quick checks (outputs, pairing) run
    kernels = WarmKernels()
    kernels.prepare()
    yield kernels
    kernels.close()


@pytest.mark.ui
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, warm_kernels):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    if path.stem in ("watch_your_vllm", "flight_recorder_incident"):
        from workbench.adapters.vllm.server import vllm_python
        if not vllm_python().exists():
            pytest.skip(f"no vLLM environment at {vllm_python()} (make vllm installs it)")
    nb = nbformat.read(path, as_version=4)
    # The kernel is this interpreter (the project's venv), started fresh in the notebooks folder.
    km = warm_kernels.take(ahead=path != NOTEBOOKS[-1])
    client = NotebookClient(nb, km=km, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}")
    finally:
        warm_kernels.stop(km)
