/* The attention check's clean path, compiled: the write and read errors of one checked row set in one
 * call (probes/attention_native.py; the numpy twin is probes/attention_numpy.py, the reference the
 * module's trial compares this with).
 *
 * Why C: the check runs on every forward, right after a layer's attention, when the CPU's caches hold
 * the forward's weights; each small numpy / torch op costs a cold dispatch there, and a decode row's
 * write and read errors took ~20 of them. Here they are one call that reads the request's K/V straight
 * from its pages (no gathered copy) and does the float32 attention of the checked rows.
 *
 * Written for any C compiler and CPU (no intrinsics, no -march): the dot products keep 8 partial
 * sums so the compiler vectorises them with the baseline vector width. Independent of the kernels it
 * checks: plain loops over the request's own page list, the causal mask by position (key j is read
 * by the row at position p iff j <= p), the model's scale and the GQA map (query head h reads KV head
 * h / (Hq / Hkv)). NaN anywhere in what is compared makes the error NaN, never clean. Page ids are
 * bounds-checked: an id outside the cache raises IndexError, as numpy's indexing does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Py_buffer v;
    int held;
} buf_t;

static int hold(PyObject *o, buf_t *b, char fmt, int ndim, const char *what) {
    b->held = 0;
    if (PyObject_GetBuffer(o, &b->v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    b->held = 1;
    Py_ssize_t want = fmt == 'f' ? 4 : 8;
    const char *f = b->v.format;
    if (f && (f[0] == '<' || f[0] == '=' || f[0] == '@')) f++;
    int ok_fmt = f && (f[0] == fmt || (fmt == 'q' && f[0] == 'l' && b->v.itemsize == 8)) && f[1] == 0;
    if (b->v.itemsize != want || !ok_fmt || b->v.ndim != ndim) {
        PyErr_Format(PyExc_TypeError, "attention_check: %s must be a C-contiguous %s array of %d dimensions",
                     what, fmt == 'f' ? "float32" : "int64", ndim);
        return -1;
    }
    return 0;
}

static void let_go(buf_t *b, int k) {
    for (int i = 0; i < k; i++)
        if (b[i].held) PyBuffer_Release(&b[i].v);
}

static inline float dot(const float *a, const float *b, Py_ssize_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    Py_ssize_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[d + l] * b[d + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* max |got - want| and max |want| folded into (*diff, *norm); NaN in either sets *nan */
static inline void fold(const float *got, const float *want, Py_ssize_t n, float *diff, float *norm, int *nan) {
    float dm = *diff, nm = *norm;
    int bad = 0;
    for (Py_ssize_t d = 0; d < n; d++) {
        float e = fabsf(got[d] - want[d]), w = fabsf(want[d]);
        bad |= (e != e);
        dm = e > dm ? e : dm;
        nm = w > nm ? w : nm;
    }
    *diff = dm, *norm = nm;
    *nan |= bad;
}

static double rel(float diff, float norm, int nan) {
    if (nan) return NAN;
    return (double)diff / (norm > 1e-30f ? (double)norm : 1e-30);
}

/* the rows of keys j0 .. (the page holding j0, ps keys from it): in the request's page of the cache, or, for a
 * whole prompt (whole), in what the layer handed to the write */
static inline const float *page_rows(int whole, const float *fresh, const float *cache, const int64_t *pages,
                                     Py_ssize_t j0, Py_ssize_t ps, Py_ssize_t row) {
    return whole ? fresh + j0 * row : cache + (size_t)pages[j0 / ps] * ps * row;
}

/* check(k_cache, v_cache, pages, ctx, start, k_new, v_new, q, o, pos, scale) -> (write, read)
 *   k_cache, v_cache  float32 [num_pages, page_size, Hkv, D]: the layer's cache
 *   pages             a list of ints or int64 [>= ceil(ctx / page_size)]: the request's own page list
 *   k_new, v_new      float32 [ctx - start, Hkv, D]: what the layer handed to the write
 *   q, o              float32 [r, Hq, D]: the checked rows' queries and attention output; q None: no read
 *   pos               int64 [r]: the checked rows' positions
 * write: max over K and V of max |stored - handed| / max |handed| over positions [start, ctx);
 * read: max |o - attention(q, K, V)| / max |attention(q, K, V)|, over the stored K/V, or over k_new /
 * v_new when start == 0 (a whole prompt attends to what it computed); None without q. */
static PyObject *check(PyObject *self, PyObject *args) {
    PyObject *okc, *ovc, *opages, *okn, *ovn, *oq, *oo, *opos;
    Py_ssize_t ctx, start;
    double scale;
    if (!PyArg_ParseTuple(args, "OOOnnOOOOOd", &okc, &ovc, &opages, &ctx, &start, &okn, &ovn, &oq, &oo, &opos,
                          &scale))
        return NULL;
    buf_t b[8];
    memset(b, 0, sizeof b);         /* let_go releases only what hold() took */
    int nb = oq == Py_None ? 5 : 8;
    PyObject *result = NULL;
    float *scores = NULL, *acc = NULL;
    int64_t *plist = NULL;
    if (hold(okc, &b[0], 'f', 4, "k_cache") < 0 || hold(ovc, &b[1], 'f', 4, "v_cache") < 0 ||
        (!PyList_Check(opages) && hold(opages, &b[2], 'q', 1, "pages") < 0) || hold(okn, &b[3], 'f', 3, "k_new") < 0 ||
        hold(ovn, &b[4], 'f', 3, "v_new") < 0)
        goto done;
    /* the page list as the sequence holds it (a Python list: read here, no array made for each call), or an
     * int64 array */
    Py_ssize_t listed;
    const int64_t *pages;
    if (PyList_Check(opages)) {
        listed = PyList_GET_SIZE(opages);
        plist = malloc(sizeof(int64_t) * (size_t)(listed > 0 ? listed : 1));
        if (!plist) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < listed; i++) {
            long long v = PyLong_AsLongLong(PyList_GET_ITEM(opages, i));
            if (v == -1 && PyErr_Occurred()) goto done;
            plist[i] = v;
        }
        pages = plist;
    } else {
        listed = b[2].v.shape[0];
        pages = b[2].v.buf;
    }
    if (nb == 8 && (hold(oq, &b[5], 'f', 3, "q") < 0 || hold(oo, &b[6], 'f', 3, "o") < 0 ||
                    hold(opos, &b[7], 'q', 1, "pos") < 0))
        goto done;
    const Py_ssize_t P = b[0].v.shape[0], ps = b[0].v.shape[1], hkv = b[0].v.shape[2], D = b[0].v.shape[3];
    const Py_ssize_t n = ctx - start, npg = ps > 0 ? (ctx + ps - 1) / ps : 0;
    if (ps <= 0 || start < 0 || n < 0 || listed < npg || b[1].v.shape[0] != P || b[1].v.shape[1] != ps ||
        b[1].v.shape[2] != hkv || b[1].v.shape[3] != D || b[3].v.shape[0] != n || b[4].v.shape[0] != n ||
        b[3].v.shape[1] != hkv || b[3].v.shape[2] != D || b[4].v.shape[1] != hkv || b[4].v.shape[2] != D) {
        PyErr_SetString(PyExc_ValueError, "attention_check: the caches, page list and new K/V do not agree in shape");
        goto done;
    }
    const float *kc = b[0].v.buf, *vc = b[1].v.buf, *kn = b[3].v.buf, *vn = b[4].v.buf;
    const Py_ssize_t row = hkv * D;
    for (Py_ssize_t i = 0; i < npg; i++)
        if (pages[i] < 0 || pages[i] >= P) {
            PyErr_Format(PyExc_IndexError, "attention_check: page %lld (index %zd of the page list) is outside the "
                         "cache's %zd pages", (long long)pages[i], i, P);
            goto done;
        }
#define STORED(cache, t) ((cache) + ((size_t)pages[(t) / ps] * ps + (t) % ps) * row)

    /* write: what the cache holds at the request's slots vs what the layer handed to the write */
    float kd = 0, knorm = 0, vd = 0, vnorm = 0;
    int knan = 0, vnan = 0;
    for (Py_ssize_t t = start; t < ctx; t++) {
        fold(STORED(kc, t), kn + (t - start) * row, row, &kd, &knorm, &knan);
        fold(STORED(vc, t), vn + (t - start) * row, row, &vd, &vnorm, &vnan);
    }
    double wk = rel(kd, knorm, knan), wv = rel(vd, vnorm, vnan);
    double write = (isnan(wk) || isnan(wv)) ? NAN : (wk > wv ? wk : wv);
    if (n == 0) write = 0.0;

    if (nb == 5) {
        result = Py_BuildValue("dO", write, Py_None);
        goto done;
    }
    const Py_ssize_t r = b[5].v.shape[0], hq = b[5].v.shape[1];
    if (b[5].v.shape[2] != D || b[6].v.shape[0] != r || b[6].v.shape[1] != hq || b[6].v.shape[2] != D ||
        b[7].v.shape[0] != r || hkv == 0 || hq % hkv != 0) {
        PyErr_SetString(PyExc_ValueError, "attention_check: q, o and pos do not agree with the caches' heads");
        goto done;
    }
    const float *q = b[5].v.buf, *o = b[6].v.buf;
    const int64_t *pos = b[7].v.buf;
    const Py_ssize_t g = hq / hkv;
    const int whole = start == 0;            /* a whole prompt attends to the K/V it computed */
    /* scores [hq, ctx], acc [hq, D]: each key row (all of its heads, hkv * D floats, contiguous) is read
     * once per checked row, page by page (no division per key; a page's rows are one contiguous run
     * the hardware prefetches), the KV head loop inside */
    scores = malloc(sizeof(float) * (size_t)(hq * (ctx > 0 ? ctx : 1)));
    acc = malloc(sizeof(float) * (size_t)(hq * D));
    if (!scores || !acc) {
        PyErr_NoMemory();
        goto done;
    }
    float rd = 0, rnorm = 0;
    int rnan = 0;
    const float fscale = (float)scale;
    for (Py_ssize_t i = 0; i < r; i++) {
        Py_ssize_t keys = pos[i] + 1 < ctx ? pos[i] + 1 : ctx;      /* keys 0 .. min(pos, ctx - 1) */
        if (keys <= 0) {
            PyErr_Format(PyExc_ValueError, "attention_check: row %zd's position %lld reads no key", i, (long long)pos[i]);
            goto done;
        }
        const float *qi = q + i * hq * D;
        for (Py_ssize_t j0 = 0; j0 < keys; j0 += ps) {              /* one page (or the prompt's rows) a pass */
            const Py_ssize_t j1 = j0 + ps < keys ? j0 + ps : keys;
            const float *base = page_rows(whole, kn, kc, pages, j0, ps, row);
            for (Py_ssize_t j = j0; j < j1; j++) {
                const float *kr = base + (j - j0) * row;
                for (Py_ssize_t h = 0; h < hkv; h++)
                    for (Py_ssize_t x = 0; x < g; x++)
                        scores[(h * g + x) * keys + j] = dot(qi + (h * g + x) * D, kr + h * D, D) * fscale;
            }
        }
        for (Py_ssize_t x = 0; x < hq; x++) {         /* softmax over the row's keys, float32 as the twin */
            float *sx = scores + x * keys, m = sx[0];
            for (Py_ssize_t j = 1; j < keys; j++) m = sx[j] > m || sx[j] != sx[j] ? sx[j] : m;
            float sum = 0;
            for (Py_ssize_t j = 0; j < keys; j++) sum += (sx[j] = expf(sx[j] - m));
            float inv = 1.0f / sum;
            for (Py_ssize_t j = 0; j < keys; j++) sx[j] *= inv;
        }
        for (Py_ssize_t e = 0; e < hq * D; e++) acc[e] = 0;
        for (Py_ssize_t j0 = 0; j0 < keys; j0 += ps) {
            const Py_ssize_t j1 = j0 + ps < keys ? j0 + ps : keys;
            const float *base = page_rows(whole, vn, vc, pages, j0, ps, row);
            for (Py_ssize_t j = j0; j < j1; j++) {
                const float *vr = base + (j - j0) * row;
                for (Py_ssize_t h = 0; h < hkv; h++)
                    for (Py_ssize_t x = 0; x < g; x++) {
                        const float w = scores[(h * g + x) * keys + j];
                        float *a = acc + (h * g + x) * D;
                        const float *v = vr + h * D;
                        for (Py_ssize_t d = 0; d < D; d++) a[d] += w * v[d];
                    }
            }
        }
        fold(o + i * hq * D, acc, hq * D, &rd, &rnorm, &rnan);
    }
    result = Py_BuildValue("dd", write, rel(rd, rnorm, rnan));
#undef STORED
done:
    free(scores);
    free(acc);
    free(plist);
    let_go(b, nb);
    return result;
}

/* rms_norm(h, w, eps, out): out = w * h / sqrt(mean(h * h) + eps) per row; h, out float32 [r, dm], w [dm]
 * (the mean in double: within float32's rounding of the twin's float32 mean) */
static PyObject *rms_norm(PyObject *self, PyObject *args) {
    PyObject *oh, *ow, *oout;
    double eps;
    if (!PyArg_ParseTuple(args, "OOdO", &oh, &ow, &eps, &oout)) return NULL;
    buf_t b[3];
    memset(b, 0, sizeof b);         /* let_go releases only what hold() took */
    PyObject *result = NULL;
    if (hold(oh, &b[0], 'f', 2, "h") < 0 || hold(ow, &b[1], 'f', 1, "w") < 0 || hold(oout, &b[2], 'f', 2, "out") < 0)
        goto done;
    const Py_ssize_t r = b[0].v.shape[0], dm = b[0].v.shape[1];
    if (b[1].v.shape[0] != dm || b[2].v.shape[0] != r || b[2].v.shape[1] != dm || b[2].v.readonly) {
        PyErr_SetString(PyExc_ValueError, "attention_check.rms_norm: h, w and out do not agree (or out is read-only)");
        goto done;
    }
    const float *h = b[0].v.buf, *w = b[1].v.buf;
    float *out = b[2].v.buf;
    for (Py_ssize_t i = 0; i < r; i++) {
        double ss = 0;
        for (Py_ssize_t d = 0; d < dm; d++) ss += (double)h[i * dm + d] * h[i * dm + d];
        const float inv = (float)(1.0 / sqrt(ss / (double)dm + eps));
        for (Py_ssize_t d = 0; d < dm; d++) out[i * dm + d] = w[d] * (h[i * dm + d] * inv);
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    let_go(b, 3);
    return result;
}

/* max |got - rope(raw)| and max |rope(raw)| over heads [r, H, D] of raw rows (row stride `stride`, heads
 * from column `col`), rotate-half at positions pos, frequencies theta ** (-2i / D) in double, then float32 */
static void rope_fold(const float *raw, Py_ssize_t stride, Py_ssize_t col, const float *got, Py_ssize_t r,
                      Py_ssize_t heads, Py_ssize_t D, const int64_t *pos, const float *inv, float *scratch, float *diff,
                      float *norm, int *nan) {
    const Py_ssize_t half = D / 2;
    float *cs = scratch, *want = scratch + D;          /* cos | sin of the row's angles; the rotated head */
    for (Py_ssize_t i = 0; i < r; i++) {
        for (Py_ssize_t f = 0; f < half; f++) {
            const float emb = (float)pos[i] * inv[f];
            cs[f] = cosf(emb), cs[half + f] = sinf(emb);
        }
        for (Py_ssize_t h = 0; h < heads; h++) {
            const float *x = raw + i * stride + col + h * D, *g = got + (i * heads + h) * D;
            for (Py_ssize_t d = 0; d < half; d++) {
                want[d] = x[d] * cs[d] + (-x[d + half]) * cs[half + d];
                want[d + half] = x[d + half] * cs[d] + x[d] * cs[half + d];
            }
            fold(g, want, D, diff, norm, nan);
        }
    }
}

/* rope(qkv, q_size, kv_size, head_dim, theta, q, k, pos) -> error
 *   qkv float32 [r, >= q_size + kv_size]: the layer's projection of the rows' input, not rotated
 *   q float32 [r, q_size / head_dim, head_dim] or None, k [r, kv_size / head_dim, head_dim]: what the layer
 *   rotated; error: max of rel(q, rope(q part)) and rel(k, rope(k part)), each over the whole tensor */
static PyObject *rope(PyObject *self, PyObject *args) {
    PyObject *oqkv, *oq, *ok, *opos;
    Py_ssize_t q_size, kv_size, D;
    double theta;
    if (!PyArg_ParseTuple(args, "OnnndOOO", &oqkv, &q_size, &kv_size, &D, &theta, &oq, &ok, &opos)) return NULL;
    buf_t b[4];
    memset(b, 0, sizeof b);         /* let_go releases only what hold() took */
    PyObject *result = NULL;
    float *inv = NULL;
    int have_q = oq != Py_None;
    if (hold(oqkv, &b[0], 'f', 2, "qkv") < 0 || hold(ok, &b[1], 'f', 3, "k") < 0 || hold(opos, &b[2], 'q', 1, "pos") < 0 ||
        (have_q && hold(oq, &b[3], 'f', 3, "q") < 0))
        goto done;
    const Py_ssize_t r = b[0].v.shape[0], cols = b[0].v.shape[1];
    if (D <= 0 || D % 2 || q_size % D || kv_size % D || cols < q_size + kv_size || b[2].v.shape[0] != r ||
        b[1].v.shape[0] != r || b[1].v.shape[1] * D != kv_size || b[1].v.shape[2] != D ||
        (have_q && (b[3].v.shape[0] != r || b[3].v.shape[1] * D != q_size || b[3].v.shape[2] != D))) {
        PyErr_SetString(PyExc_ValueError, "attention_check.rope: qkv, q, k and pos do not agree in shape");
        goto done;
    }
    inv = malloc(sizeof(float) * (size_t)(D / 2 + 2 * D));    /* frequencies, then rope_fold's scratch */
    if (!inv) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t f = 0; f < D / 2; f++) inv[f] = (float)(1.0 / pow(theta, (double)(2 * f) / (double)D));
    const int64_t *pos = b[2].v.buf;
    float qd = 0, qn = 0, kd = 0, kn = 0;
    int qnan = 0, knan = 0;
    if (have_q)
        rope_fold(b[0].v.buf, cols, 0, b[3].v.buf, r, q_size / D, D, pos, inv, inv + D / 2, &qd, &qn, &qnan);
    rope_fold(b[0].v.buf, cols, q_size, b[1].v.buf, r, kv_size / D, D, pos, inv, inv + D / 2, &kd, &kn, &knan);
    double eq = have_q ? rel(qd, qn, qnan) : 0.0, ek = rel(kd, kn, knan);
    result = PyFloat_FromDouble(isnan(eq) || isnan(ek) ? NAN : (eq > ek ? eq : ek));
done:
    free(inv);
    let_go(b, have_q ? 4 : 3);
    return result;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, "rms_norm(h, w, eps, out): out = w * h / sqrt(mean(h * h) + eps), per row"},
    {"rope", rope, METH_VARARGS, "rope(qkv, q_size, kv_size, head_dim, theta, q, k, pos) -> error of the rotation"},
    {"check", check, METH_VARARGS, "check(k_cache, v_cache, pages, ctx, start, k_new, v_new, q, o, pos, scale) -> "
                                   "(write error, read error or None)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedkv_attention_check",
                                    "the attention check's clean path, compiled", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_pagedkv_attention_check(void) { return PyModule_Create(&module); }
