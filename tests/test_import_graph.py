"""No import circles and no upward imports in workbench/ and probes/, against docs/design/layers.md.

The graph is built from the sources with ast (every `import` and `from ... import`, at module level
or inside a function: a lazy import is still a dependency). A cycle is a strongly connected set of
two or more modules; an upward import is one from a module to a module of a higher layer in the
list docs/design/layers.md writes down.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS_DOC = ROOT / "docs" / "design" / "layers.md"


def modules() -> dict[str, Path]:
    out = {}
    for pkg in ("workbench", "probes"):
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {}
    for m, path in mods.items():
        is_pkg = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = m.split(".") if is_pkg else m.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    b = ".".join(base + ([node.module] if node.module else []))
                else:
                    b = node.module or ""
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                names = [f"{b}.{a.name}" if f"{b}.{a.name}" in mods else b for a in node.names]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != m:
                    targets.add(name)
        edges[m] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of 2+ modules (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def layers() -> list[list[str]]:
    text = LAYERS_DOC.read_text()
    block = re.search(r"<!-- layers:.*?-->(.*?)<!-- /layers -->", text, re.S)
    assert block, f"{LAYERS_DOC}: no <!-- layers --> ... <!-- /layers --> list"
    return [re.findall(r"`([\w.]+)`", line) for line in block.group(1).splitlines() if re.match(r"\s*\d+\.", line)]


def layer_of(module: str, order: list[list[str]]) -> int:
    best, level = -1, None
    for i, names in enumerate(order):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best:
                best, level = len(n), i
    assert level is not None, f"module {module} is in no layer of {LAYERS_DOC.relative_to(ROOT)}: add its package"
    return level


def test_there_are_no_import_circles():
    found = cycles(import_graph())
    assert found == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_higher_layer():
    order = layers()
    assert len(order) >= 10
    edges = import_graph()
    up = sorted(f"{m} (layer {layer_of(m, order) + 1}) imports {t} (layer {layer_of(t, order) + 1})"
                for m, ts in edges.items() for t in ts if layer_of(t, order) > layer_of(m, order))
    assert up == [], "upward imports:\n" + "\n".join(up)


def test_the_checker_sees_a_circle_and_an_upward_import():
    # the test must be able to fail: a made-up graph with both
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    order = [["workbench.events"], ["workbench.engine"]]
    assert layer_of("workbench.engine.step", order) == 1 and layer_of("workbench.events", order) == 0
    edges = import_graph()
    assert "workbench.engine.kernel_selection" in edges["workbench.engine.repage"]     # lazy imports seen too
    assert "workbench.engine.attention" in edges["workbench.engine.kernel_selection"]
