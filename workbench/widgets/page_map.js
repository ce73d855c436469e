// Page map: one byte per page -> one canvas cell (code = state | hue << 2, colour = palette[code]).
// draw() is shared by the anywidget view below and the static HTML export.

const STATES = ["free", "cached", "owned", "shared"];

export function bytesOf(v) {
  if (v instanceof Uint8Array) return v;
  if (v instanceof DataView) return new Uint8Array(v.buffer, v.byteOffset, v.byteLength);
  if (v instanceof ArrayBuffer) return new Uint8Array(v);
  if (typeof v === "string") {                       // base64 (static export)
    const s = atob(v);
    const a = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) a[i] = s.charCodeAt(i);
    return a;
  }
  return new Uint8Array(0);
}

export function draw(canvas, { codes, palette, cols, cell, numPages, highlight = [], selected = -1 }) {
  const rows = Math.max(1, Math.ceil(numPages / cols));
  const w = cols * cell, h = rows * cell;
  if (canvas.width !== w) canvas.width = w;
  if (canvas.height !== h) canvas.height = h;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(w, h);
  const px = new Uint32Array(img.data.buffer);       // RGBA bytes, little-endian: 0xAABBGGRR
  const lut = new Uint32Array(256);
  for (let c = 0; c < 256; c++) {
    lut[c] = ((255 << 24) | (palette[3 * c + 2] << 16) | (palette[3 * c + 1] << 8) | palette[3 * c]) >>> 0;
  }
  px.fill(0xffffffff);                               // white gaps and the unused tail
  const inner = cell >= 4 ? cell - 1 : cell;         // a 1 px gap once cells are big enough to see it
  const n = Math.min(numPages, codes.length);
  for (let p = 0; p < n; p++) {
    const colour = lut[codes[p]];
    const x0 = (p % cols) * cell, y0 = ((p / cols) | 0) * cell;
    if (inner === 1) { px[y0 * w + x0] = colour; continue; }
    for (let dy = 0; dy < inner; dy++) {
      const at = (y0 + dy) * w + x0;
      px.fill(colour, at, at + inner);
    }
  }
  ctx.putImageData(img, 0, 0);
  const ring = (p, colour) => {
    const x0 = (p % cols) * cell, y0 = ((p / cols) | 0) * cell;
    ctx.strokeStyle = colour;
    ctx.lineWidth = 2;
    ctx.strokeRect(x0 - 1, y0 - 1, cell + 1, cell + 1);
  };
  for (const p of highlight) if (p >= 0 && p < numPages) ring(p, "#e00000");   // pages a finding names
  if (selected >= 0 && selected < numPages) ring(selected, "#000000");       // the page clicked
}

export function pageAt(canvas, cols, cell, numPages, event) {
  const r = canvas.getBoundingClientRect();
  const sx = canvas.width / Math.max(1, r.width), sy = canvas.height / Math.max(1, r.height);
  const x = Math.floor(((event.clientX - r.left) * sx) / cell);
  const y = Math.floor(((event.clientY - r.top) * sy) / cell);
  const p = y * cols + x;
  return x >= 0 && x < cols && p >= 0 && p < numPages ? p : -1;
}

export function counts(codes, numPages) {
  const c = [0, 0, 0, 0];
  for (let p = 0; p < Math.min(numPages, codes.length); p++) c[codes[p] & 3]++;
  return c;
}

function swatch(palette, code, label) {
  const s = document.createElement("span");
  s.className = "kvwb-swatch";
  const rgb = `rgb(${palette[3 * code]},${palette[3 * code + 1]},${palette[3 * code + 2]})`;
  s.innerHTML = `<i style="display:inline-block;width:10px;height:10px;margin:0 3px 0 8px;background:${rgb}"></i>${label}`;
  return s;
}

function describe(d) {
  if (!d) return "";
  const parts = [`page ${d.page}`, d.state];
  if (d.owners && d.owners.length) parts.push(`owner request${d.owners.length > 1 ? "s" : ""} ${d.owners.join(", ")}`);
  for (const k of ["ref", "fill", "generation", "prefix_hash", "step", "note", "detail_error", "error"]) {
    if (d[k] !== undefined && d[k] !== null) parts.push(`${k} ${d[k]}`);
  }
  return parts.join(" · ");
}

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "kvwb-page-map";
  root.style.cssText = "font: 12px sans-serif; display: inline-block;";
  const head = document.createElement("div");
  head.className = "kvwb-page-map-head";
  const legend = document.createElement("div");
  legend.className = "kvwb-page-map-legend";
  const canvas = document.createElement("canvas");
  canvas.style.cssText = "image-rendering: pixelated; display: block; cursor: crosshair; margin: 4px 0;";
  const info = document.createElement("div");
  info.className = "kvwb-page-info";
  info.style.cssText = "min-height: 1.4em; font-family: monospace;";
  root.append(head, legend, canvas, info);
  el.appendChild(root);

  const palette = () => bytesOf(model.get("palette"));
  const codes = () => bytesOf(model.get("codes"));
  const pal = palette();
  legend.append(swatch(pal, 0, "free"), swatch(pal, 1, "cached"), swatch(pal, 2 | (1 << 2), "owned"),
                swatch(pal, 3 | (1 << 2), "shared (darker)"), document.createTextNode(" · hue: owner request"));

  let pending = false;
  const paint = () => {
    pending = false;
    const n = model.get("num_pages");
    const c = codes();
    draw(canvas, { codes: c, palette: palette(), cols: model.get("cols"), cell: model.get("cell"), numPages: n,
                   highlight: model.get("highlight"), selected: model.get("selected") });
    canvas.dataset.version = model.get("version");
    canvas.dataset.step = model.get("step");
    const k = counts(c, n);
    const title = model.get("title");
    head.textContent = `${title ? title + " · " : ""}step ${model.get("step")} · ${n} pages: ` +
      STATES.map((s, i) => `${k[i]} ${s}`).join(", ");
  };
  // One kernel message sets several traits; paint once after all of them.
  const schedule = () => { if (!pending) { pending = true; queueMicrotask(paint); } };
  const traits = ["codes", "highlight", "selected", "version", "cols", "cell"];
  for (const name of traits) model.on(`change:${name}`, schedule);

  let last = -1, lastSent = 0, timer = null;
  const local = (p) => `page ${p} · ${STATES[codes()[p] & 3]}`;
  const ask = (type, p) => model.send({ type, page: p });
  const onMove = (e) => {
    const p = pageAt(canvas, model.get("cols"), model.get("cell"), model.get("num_pages"), e);
    if (p === last) return;
    last = p;
    if (p < 0) { info.textContent = ""; return; }
    info.textContent = local(p);
    // Details come from the kernel on demand; at most one request per 50 ms while moving.
    clearTimeout(timer);
    const wait = Math.max(0, 50 - (performance.now() - lastSent));
    timer = setTimeout(() => { lastSent = performance.now(); ask("hover", last); }, wait);
  };
  const onClick = (e) => {
    const p = pageAt(canvas, model.get("cols"), model.get("cell"), model.get("num_pages"), e);
    if (p >= 0) { info.textContent = local(p); ask("click", p); }
  };
  const onLeave = () => { last = -1; clearTimeout(timer); };
  const onMsg = (msg) => {
    if (msg && msg.type === "detail" && msg.detail && (msg.detail.page === last || last < 0)) {
      info.textContent = describe(msg.detail);
    }
  };
  canvas.addEventListener("mousemove", onMove);
  canvas.addEventListener("click", onClick);
  canvas.addEventListener("mouseleave", onLeave);
  model.on("msg:custom", onMsg);
  paint();
  return () => {
    clearTimeout(timer);
    for (const name of traits) model.off(`change:${name}`, schedule);
    model.off("msg:custom", onMsg);
  };
}

export default { render };
