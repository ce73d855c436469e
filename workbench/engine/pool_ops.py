"""The page pool's per-page loops: Python here, compiled (csrc/pool_ops.c) when a C compiler is at hand.

A simulated replay of a production trace hands out, registers and frees millions of pages:
these loops were half of its time. Each is a plain function over the PagePool's own
arrays, lists and dict (the pool keeps one representation, which probes and views read:
per-page integers in array.array('q') / ('b'), per-page objects in lists), written here in
Python, the reference, and in C with the same arguments and results:

    take(nxt, prv, is_free, page_hash, page_tokens, page_index, page_parent, generation, ref, cached, ids, head, n)
        -> (pages, generations, evicted, head)    n pages off the free queue's head (ids[p]: page p's int)
    release(ref, nxt, prv, is_free, page_hash, pages, head, tail)
        -> (released, still, cached, head, tail, error)   one reference dropped per page
    register_chain(cached, page_hash, page_tokens, page_index, page_parent, pages, chain, index, parent)
        -> (entered, indices)                     consecutive pages entered in the prefix cache
    walk(memo, n, cached, page_tokens) -> (pages, hashes)   the longest cached prefix
    hash_chain(root, parent, blocks) -> [(hash, block), ...]  each hash((previous or root, block))
    count_free(is_free, pages) -> int             how many of pages are on the free queue

The C source is compiled once per machine with the interpreter's C compiler (~1 s) by the
kernels loader (engine/kernels/), into a cache entry under $PAGEDKV_EXTENSIONS_DIR or
~/.cache/pagedkv-workbench/torch_extensions keyed by the source, compiler, torch and Python.
No compiler, PAGEDKV_POOL=python, or a refused build: the Python functions run, same results, slower.
tests/test_page_pool.py runs the pool on both.
"""
from __future__ import annotations

import threading
from array import array
from pathlib import Path
from types import SimpleNamespace

from . import kernels

NIL = -1
SOURCE = Path(__file__).with_name("csrc") / "pool_ops.c"


# ---- the reference: Python ------------------------------------------------------------------
def take(nxt, prv, is_free, page_hash, tokens, index, parent, gen, ref, cached, ids, head, n):
    # ids[p] is page p's int object: the pool's lists then share one object per page id
    # instead of a new int per hand-out (millions in a replay)
    pages, gens, evicted = [], [], []
    p = head
    for _ in range(n):
        if p == NIL:
            raise RuntimeError(f"pool_ops: the free queue ends after {len(pages)} of {n} pages")
        q = nxt[p]
        nxt[p] = prv[p] = NIL
        is_free[p] = False
        if page_hash[p] is not None:
            evicted.append(p)
        gen[p] += 1
        ref[p] = 1
        pages.append(ids[p])
        gens.append(gen[p])
        p = q
    if p != NIL:
        prv[p] = NIL
    for e in evicted:                          # a cached page handed out loses its hash
        h = page_hash[e]
        if cached.get(h) == e:
            del cached[h]
        page_hash[e] = tokens[e] = parent[e] = None
        index[e] = NIL
    return pages, gens, evicted, p


def release(ref, nxt, prv, is_free, page_hash, pages, head, tail):
    released, still, cached, error = [], [], [], None
    try:
        for p in pages:
            r = ref[p]
            if r <= 0:
                raise RuntimeError(f"page {p} freed with refcount {r}")
            ref[p] = r - 1
            if r == 1:                         # onto the free queue's tail
                prv[p], nxt[p] = tail, NIL
                if tail == NIL:
                    head = p
                else:
                    nxt[tail] = p
                tail = p
                is_free[p] = True
                if page_hash[p] is not None:
                    cached.append(p)
                released.append(p)
            else:
                still.append(p)
    except Exception as e:                     # raised by the caller once its counters are kept
        error = e
    return released, still, cached, head, tail, error


def register_chain(cached, page_hash, tokens, page_index, page_parent, pages, chain, index, parent):
    entered, indices = [], []
    for p, (h, key) in zip(pages, chain):
        if page_hash[p] is None and h not in cached:
            cached[h] = p
            page_hash[p] = h
            tokens[p] = key
            page_index[p] = index
            page_parent[p] = parent
            entered.append(p)
            indices.append(index)
        parent = h
        index += 1
    return entered, indices


def walk(memo, n, cached, tokens):
    pages, hashes = [], []
    for h, key in memo[:n]:
        p = cached.get(h)
        if p is None or tokens[p] != key:
            break
        pages.append(p)
        hashes.append(h)
    return pages, hashes


def count_free(is_free, pages):
    return sum(map(is_free.__getitem__, pages))


def hash_chain(root, parent, blocks):
    out = []
    h = root if parent is None else parent
    for block in blocks:
        h = hash((h, block))
        out.append((h, block))
    return out


PYTHON = SimpleNamespace(name="python", take=take, release=release, register_chain=register_chain, walk=walk,
                         hash_chain=hash_chain, count_free=count_free)


# ---- the compiled twin --------------------------------------------------------------------
def build_dir() -> Path:
    """Where the compiled loops' cache entries live (the one kernels cache, engine/kernels/cache.py)."""
    return kernels.build_dir()


_EXTRA: dict = {}                               # load_extension's specs for sources not in kernels.ALL


def load_extension(source: Path, name: str):
    """The C module `name` from `source`, through the kernels loader (built once per machine and
    source, refused when built for CPU features this one lacks); raises with the reason."""
    for k in kernels.ALL.values():
        if k.spec.name == name and k.spec.sources == (Path(source),):
            return k.require()
    if name not in _EXTRA:
        _EXTRA[name] = kernels.Kernel(kernels.Spec(name, (Path(source),), f"compiled {name}", kind="c",
                                                   flags=kernels.extensions.C_FLAGS, headers=()),
                                      fallback="the Python loops")
    return _EXTRA[name].require()


def _state(n: int = 6) -> dict:
    """A fresh n-page pool in the PagePool's representation (pages.py): every page free, in order."""
    return dict(nxt=array("q", range(1, n + 1)), prv=array("q", range(-1, n - 1)), is_free=array("b", b"\x01" * n),
                page_hash=[None] * n, tokens=[None] * n, index=array("q", [-1]) * n, parent=[None] * n,
                gen=array("q", bytes(8 * n)), ref=array("q", bytes(8 * n)), cached={}, ids=list(range(n)),
                head=0, tail=n - 1)


def _script(ops, st: dict) -> list:
    """Take, register a chain, release, walk and take again (evicting a cached page): every result and
    the state after, for comparing two implementations."""
    st["nxt"][st["tail"]] = NIL
    out = []
    pages, gens, evicted, st["head"] = ops.take(st["nxt"], st["prv"], st["is_free"], st["page_hash"], st["tokens"],
                                               st["index"], st["parent"], st["gen"], st["ref"], st["cached"],
                                               st["ids"], st["head"], 3)
    out += [pages, gens, evicted, st["head"]]
    chain = ops.hash_chain(11, None, [(1, 2), (3, 4), (5, 6)])
    out += [chain, ops.register_chain(st["cached"], st["page_hash"], st["tokens"], st["index"], st["parent"],
                                      pages, chain, 0, None)]
    released, still, cached, st["head"], st["tail"], error = ops.release(
        st["ref"], st["nxt"], st["prv"], st["is_free"], st["page_hash"], pages[::-1], st["head"], st["tail"])
    out += [released, still, cached, st["head"], st["tail"], error, ops.walk(chain, 3, st["cached"], st["tokens"]),
            ops.count_free(st["is_free"], list(range(6)))]
    more = ops.take(st["nxt"], st["prv"], st["is_free"], st["page_hash"], st["tokens"], st["index"], st["parent"],
                    st["gen"], st["ref"], st["cached"], st["ids"], st["head"], 4)
    out += [more, {k: (list(v) if isinstance(v, array) else v) for k, v in st.items()}]
    return out


def trial(ops) -> None:
    """The compiled loops against the Python ones on a tiny pool (kernels/trials.py: tried once, before use)."""
    got, want = _script(ops, _state()), _script(PYTHON, _state())
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise kernels.trials.Mismatch(f"page-pool loops, result {i}: {g!r} where the Python loops give {w!r}")


def _load():
    mod = kernels.POOL_OPS.require()
    return SimpleNamespace(name="compiled", take=mod.take, release=mod.release, register_chain=mod.register_chain,
                           walk=mod.walk, hash_chain=mod.hash_chain, count_free=mod.count_free)


class CompiledOnce:
    """A C twin of some Python loops (python: their namespace), made on first use by make() from
    the module the kernels loader hands it; None, with the reason, where there is none (no compiler,
    a read-only cache, PAGEDKV_POOL=python, a refused build: the loader says which)."""

    def __init__(self, make, what: str, python):
        self._make, self._what, self.python = make, what, python
        self._lock = threading.Lock()
        self.state: dict = {}                  # "ops" (None when unavailable) and "why", once tried

    def get(self):
        """The compiled loops, or None (why: why())."""
        if "ops" not in self.state:
            with self._lock:
                if "ops" not in self.state:
                    ops, why = None, None
                    try:
                        ops = self._make()
                    except Exception as e:    # the loader logged it (a refusal names the missing features)
                        why = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
                    self.state["ops"], self.state["why"] = ops, why
        return self.state["ops"]

    def why(self) -> str | None:
        self.get()
        return self.state.get("why")

    def active(self, choice: str = "auto"):
        """What a new user runs: the compiled loops when they load, else the Python ones;
        choice="python" (EngineConfig.pool_ops) the Python ones, without loading anything."""
        return self.python if choice == "python" else self.get() or self.python


_compiled = CompiledOnce(_load, "page-pool loops", PYTHON)
compiled, active, unavailable_reason = _compiled.get, _compiled.active, _compiled.why
