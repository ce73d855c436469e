"""PageMap: every page of the KV pool as one canvas cell, coloured by state and owner.

Scales to production pools (131,072 pages at >= 10 updates/s) by sending one byte per
page to a canvas drawn in the browser, never a plotly cell per page:

    code = state | hue << 2      state: 0 free, 1 cached-free, 2 owned, 3 shared
                                 hue:   0 none, else 1 + owner % 63 (a hue per request)

The palette (256 RGB triples, indexed by code) and the layout (cols, cell) are computed
here and sent once, so Python knows exactly which colour lands on which pixel (what the
tests check). Per-page details (owners, refcount, fill, generation, prefix hash) are not
sent with the bytes: the browser asks for them on hover/click and `details` answers.
"""
from __future__ import annotations

import colorsys
import math
from pathlib import Path
from typing import Callable

import anywidget
import numpy as np
import traitlets as t

from ..trace.timetravel import CACHED, FREE, SHARED, STATE_NAMES, PoolState

NUM_HUES = 63
GOLDEN_ANGLE = 137.508                      # successive request ids land far apart on the wheel
HUE_START = 30.0                            # request 0 orange, not the red of the highlight ring
FREE_RGB = (232, 232, 232)
CACHED_RGB = (160, 184, 214)
BACKGROUND_RGB = (255, 255, 255)            # the gaps between cells
JS = Path(__file__).with_name("page_map.js")


def hue_of(owner: np.ndarray) -> np.ndarray:
    """Hue index per page (0 for no owner): 1 + owner % 63."""
    owner = np.asarray(owner, dtype=np.int64)
    hue = (owner.astype(np.uint32) % NUM_HUES + 1).astype(np.uint8)     # uint32: twice as fast as int64 %
    hue[owner < 0] = 0
    return hue


def states_of(ref: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """PoolState.states (0 free, 1 cached, 2 owned, 3 shared) in a few cheap passes."""
    s = np.minimum(ref, 2).astype(np.uint8)
    s += s > 0
    s |= np.asarray(cached, dtype=bool) & (s == 0)
    return s


def encode(states: np.ndarray, owner: np.ndarray) -> bytes:
    """One byte per page: the state in the low 2 bits, the owner's hue above them."""
    states = np.asarray(states, dtype=np.uint8)
    hue = hue_of(owner)
    hue[states < 2] = 0                                                 # free pages carry no owner colour
    return (states | (hue << 2)).tobytes()


def make_palette() -> np.ndarray:
    """[256, 3] uint8: the colour of every code. Owned pages take their request's hue;
    shared pages the first owner's hue, darker, so sharing stands out."""
    pal = np.zeros((256, 3), np.uint8)
    for code in range(256):
        state, hue = code & 3, code >> 2
        if state == FREE:
            rgb = FREE_RGB
        elif state == CACHED:
            rgb = CACHED_RGB
        elif hue == 0:                                   # owned by an unknown request
            rgb = (120, 120, 120) if state == SHARED else (150, 150, 150)
        else:
            h = ((HUE_START + (hue - 1) * GOLDEN_ANGLE) % 360) / 360
            light, sat = (0.30, 0.85) if state == SHARED else (0.58, 0.70)
            rgb = tuple(round(c * 255) for c in colorsys.hls_to_rgb(h, light, sat))
        pal[code] = rgb
    return pal


PALETTE = make_palette()


def layout(num_pages: int, width: int, max_height: int) -> tuple[int, int]:
    """(cols, cell px): the largest square cell that fits num_pages into width x max_height."""
    cell = max(1, min(48, int(math.sqrt(width * max_height / max(1, num_pages)))))
    while cell > 1 and math.ceil(num_pages / (width // cell)) * cell > max_height:
        cell -= 1
    return max(1, width // cell), cell


def live_page_details(engine, page: int) -> dict:
    """Fill (tokens whose KV the page holds), generation and prefix hash of a page, read from the
    live pool and sequences (the log keeps none of them, so only the live step has them)."""
    pool = engine.pool
    ps = pool.page_size
    fill = None
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        if page in seq.pages:
            fill = max(0, min(ps, seq.num_computed_tokens - seq.pages.index(page) * ps))
            break
    if fill is None and pool.page_tokens[page] is not None:     # cached-free: a full page
        fill = len(pool.page_tokens[page])
    h = pool.page_hash[page]
    return {"fill": f"{fill or 0}/{ps}", "generation": int(pool.generation[page]),
            "prefix_hash": None if h is None else f"{h & (2**64 - 1):016x}"}


class PageMap(anywidget.AnyWidget):
    _esm = JS
    num_pages = t.Int(0).tag(sync=True)
    cols = t.Int(1).tag(sync=True)
    cell = t.Int(1).tag(sync=True)
    codes = t.Bytes(b"").tag(sync=True)            # one byte per page, sent as a binary buffer
    palette = t.Bytes(PALETTE.tobytes()).tag(sync=True)
    highlight = t.List(t.Int()).tag(sync=True)     # pages a finding names
    selected = t.Int(-1).tag(sync=True)            # the page clicked in the browser
    step = t.Int(-1).tag(sync=True)
    version = t.Int(0).tag(sync=True)              # updates sent; the browser shows it as data-version
    title = t.Unicode("").tag(sync=True)

    def __init__(self, num_pages: int, width: int = 640, max_height: int = 360,
                 details: Callable[[int], dict] | None = None, **kw):
        cols, cell = layout(num_pages, width, max_height)
        super().__init__(num_pages=num_pages, cols=cols, cell=cell, codes=bytes(num_pages), **kw)
        self.state: PoolState | None = None
        self.detail_source = details           # page -> dict of extra fields (fill, generation, hash)
        self.last_detail: dict | None = None
        self.bytes_sent = 0
        self.on_msg(self._on_msg)

    # ---- updates -------------------------------------------------------------
    def show(self, state: PoolState, highlight=None) -> bool:
        """Draw a pool state; sends only when the bytes changed. Returns whether it sent."""
        if len(state.ref) != self.num_pages:
            raise ValueError(f"pool state has {len(state.ref)} pages, the map {self.num_pages}")
        self.state = state
        codes = encode(states_of(state.ref, state.cached), state.owner)
        changed = codes != self.codes
        with self.hold_sync():
            if highlight is not None:
                self.highlight = sorted({int(p) for p in highlight if 0 <= int(p) < self.num_pages})
            if changed:
                self.codes = codes
                self.bytes_sent += len(codes)
            self.step = int(state.step)
            self.version += 1
        return changed

    def color_of(self, page: int) -> tuple[int, int, int]:
        """The RGB the browser paints page `page` with (centre of its cell)."""
        return tuple(int(c) for c in PALETTE[self.codes[page]])

    def cell_center(self, page: int) -> tuple[int, int]:
        """Canvas pixel (x, y) at the centre of page's cell."""
        return (page % self.cols) * self.cell + self.cell // 2, (page // self.cols) * self.cell + self.cell // 2

    # ---- details on demand -----------------------------------------------------
    def details(self, page: int) -> dict:
        """What hover/click shows: page id, state, owner request(s), refcount, plus the source's
        fields (fill in tokens, generation, prefix hash)."""
        if not 0 <= page < self.num_pages:
            return {"page": page, "error": "no such page"}
        st = self.state
        out = {"page": page, "state": STATE_NAMES[self.codes[page] & 3]}
        if st is not None:
            owners = st.shared_owners.get(page) or ((int(st.owner[page]),) if st.owner[page] >= 0 else ())
            out.update(step=int(st.step), ref=int(st.ref[page]), owners=[int(o) for o in owners])
        if self.detail_source is not None:
            try:
                out.update(self.detail_source(page))
            except Exception as e:                   # a view never raises into the kernel's comm loop
                out["detail_error"] = f"{type(e).__name__}: {e}"
        return out

    def _on_msg(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("type") in ("hover", "click"):
            page = int(content.get("page", -1))
            self.last_detail = d = self.details(page)
            if content["type"] == "click":
                self.selected = page
            self.send({"type": "detail", "detail": d})
