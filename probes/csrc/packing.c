/* The packing probe's checks compiled, their clean paths (probes/packing_native.py; the numpy checks in
 * probes/invariants.py and probes/plan_check.py are the reference, and report).
 *
 * batch(): every index copy of a packed batch (positions, slot_mapping, input_ids and each length copy)
 * against the batch as the sequences mean it: each row's tokens computed before the step, its chunk, its
 * own page list and token ids. The reference is walked here row by row, never built: numpy built it in
 * ~15 operations and compared each copy in ~4 more, each a cold dispatch at layer 0 (~0.25 ms a forward
 * on SmolLM2's workload A). Also the maxima the kernels size their work by, and the sampled rows.
 *
 * decode_plan(): the compiled decode kernel's plan (each query's token, batch row and context length,
 * and the table rows it walks) against the same state, for a step of decode rows only.
 *
 * Each answers True (clean: numpy would find nothing) or False (look: numpy runs, names what it finds).
 * Stricter than numpy is allowed (numpy then runs and may find nothing); laxer is not, and the trial in
 * packing_native.py plants each kind of mismatch to see that it says False.
 */
#include "buffers.h"
#include <stdlib.h>

enum { K_POSITIONS, K_SLOTS, K_INPUT_IDS, K_Q, K_DIFF_Q, K_CU_Q, K_CTX, K_CU_K, K_ENDS_Q, K_ENDS_K, K_KINDS };

typedef struct {
    Py_buffer computed, scheduled;
    int held;
    Py_ssize_t b;
    int64_t *cu_q, *ctx, *cu_k;                 /* [B+1], [B], [B+1]: from the rows' own state */
} Rows;

static void rows_free(Rows *r) {
    if (r->held > 0) PyBuffer_Release(&r->computed);
    if (r->held > 1) PyBuffer_Release(&r->scheduled);
    free(r->cu_q);
    free(r->ctx);
    free(r->cu_k);
}

/* computed [B], scheduled [B] -> cumulative lengths; -1 with an exception set where unreadable, 0 on
 * success, 1 where a length is negative (not a batch numpy's reference would call clean) */
static int rows_of(PyObject *ocomp, PyObject *osched, Rows *r, const char *who) {
    memset(r, 0, sizeof *r);
    if (hold(ocomp, &r->computed, 0, 0, who, "computed") < 0) return -1;
    r->held = 1;
    if (hold(osched, &r->scheduled, 0, 0, who, "scheduled") < 0) return -1;
    r->held = 2;
    r->b = count(&r->computed);
    if (count(&r->scheduled) != r->b) {
        PyErr_Format(PyExc_ValueError, "%s: computed and scheduled differ in length", who);
        return -1;
    }
    const Py_ssize_t b = r->b;
    r->cu_q = malloc((b + 1) * sizeof(int64_t));
    r->ctx = malloc((b ? b : 1) * sizeof(int64_t));
    r->cu_k = malloc((b + 1) * sizeof(int64_t));
    if (!r->cu_q || !r->ctx || !r->cu_k) {
        PyErr_NoMemory();
        return -1;
    }
    r->cu_q[0] = r->cu_k[0] = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        const int64_t c = ival(&r->computed, i), q = ival(&r->scheduled, i);
        if (c < 0 || q < 0) return 1;
        r->ctx[i] = c + q;
        r->cu_q[i + 1] = r->cu_q[i] + q;
        r->cu_k[i + 1] = r->cu_k[i] + c + q;
    }
    return 0;
}

/* a copy [n] against want[0..n) */
static int equal_to(const Py_buffer *got, const int64_t *want, Py_ssize_t n) {
    if (count(got) != n) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (ival(got, i) != want[i]) return 0;
    return 1;
}

/* batch(computed, scheduled, pages, token_ids, page_size, copies, max_q, max_k, logits, totals) -> bool
 *   pages        each row's own page list; token_ids: each row's token ids, or None (input ids unchecked)
 *   copies       [(kind, array)], kind one of the K_ codes (packing_native.KINDS), arrays of ints
 *   max_q/max_k  what the batch says its longest query / context is
 *   logits       the sampled rows (logits_indices); totals: each row's whole token count (a row samples
 *                when its context reaches it) */
static PyObject *batch(PyObject *self, PyObject *args) {
    PyObject *ocomp, *osched, *pages, *tokens, *copies, *ologits, *ototals;
    long long ps, max_q, max_k;
    if (!PyArg_ParseTuple(args, "OOO!OLO!LLOO", &ocomp, &osched, &PyList_Type, &pages, &tokens, &ps, &PyList_Type,
                          &copies, &max_q, &max_k, &ologits, &ototals))
        return NULL;
    if (ps <= 0) {
        PyErr_SetString(PyExc_ValueError, "packing: page_size must be positive");
        return NULL;
    }
    Rows r;
    PyObject *result = NULL;
    Py_buffer bl, bt, bc;
    int held_l = 0, held_t = 0, clean = 0, bad = 0;
    int64_t *want = NULL;
    const int st = rows_of(ocomp, osched, &r, "packing");
    if (st < 0) goto done;
    if (st > 0) goto verdict;
    const Py_ssize_t b = r.b, t_n = r.cu_q[b];
    if (PyList_GET_SIZE(pages) != b || (tokens != Py_None && (!PyList_Check(tokens) || PyList_GET_SIZE(tokens) != b)))
        goto verdict;
    if (hold(ologits, &bl, 0, 0, "packing", "logits") < 0) goto done;
    held_l = 1;
    if (hold(ototals, &bt, 0, 0, "packing", "totals") < 0) goto done;
    held_t = 1;
    if (count(&bt) != b) goto verdict;
    /* the maxima */
    int64_t mq = 0, mk = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        const int64_t q = r.cu_q[i + 1] - r.cu_q[i];
        mq = q > mq ? q : mq;
        mk = r.ctx[i] > mk ? r.ctx[i] : mk;
    }
    if (max_q != mq || max_k != mk) goto verdict;
    /* the sampled rows: every row (teacher forcing), else the last token of each row whose context
     * reaches its whole length */
    int all_rows = count(&bl) == t_n && t_n > 0;
    for (Py_ssize_t i = 0; all_rows && i < t_n; i++) all_rows = ival(&bl, i) == i;
    if (!all_rows) {
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < b; i++) {
            if (r.ctx[i] != ival(&bt, i)) continue;
            if (k >= count(&bl) || ival(&bl, k) != r.cu_q[i + 1] - 1) goto verdict;
            k++;
        }
        if (k != count(&bl)) goto verdict;
    }
    /* the copies */
    want = malloc((t_n > b + 1 ? t_n : b + 1) * sizeof(int64_t) + 8);
    if (!want) {
        PyErr_NoMemory();
        goto done;
    }
    const Py_ssize_t nc = PyList_GET_SIZE(copies);
    for (Py_ssize_t c = 0; c < nc; c++) {
        PyObject *item = PyList_GET_ITEM(copies, c);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 || !PyLong_Check(PyTuple_GET_ITEM(item, 0)))
            goto verdict;
        const long kind = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
        if (kind < 0 || kind >= K_KINDS) goto verdict;
        if (hold(PyTuple_GET_ITEM(item, 1), &bc, 0, 0, "packing", "a copy") < 0) goto done;
        int ok = 1;
        switch (kind) {
        case K_POSITIONS: case K_SLOTS: case K_INPUT_IDS:
            if (count(&bc) != t_n) {
                ok = 0;
                break;
            }
            for (Py_ssize_t i = 0; i < b && ok; i++) {
                const int64_t c0 = ival(&r.computed, i), a = r.cu_q[i], n = r.cu_q[i + 1] - a;
                PyObject *pl = PyList_GET_ITEM(pages, i), *tl = tokens == Py_None ? NULL : PyList_GET_ITEM(tokens, i);
                if (kind == K_SLOTS && !PyList_Check(pl)) ok = 0;
                if (kind == K_INPUT_IDS && tl != NULL && (!PyList_Check(tl) || PyList_GET_SIZE(tl) < c0 + n)) ok = 0;
                for (int64_t j = 0; j < n && ok; j++) {
                    const int64_t pos = c0 + j, got = ival(&bc, a + j);
                    if (kind == K_POSITIONS) ok = got == pos;
                    else if (kind == K_SLOTS) {
                        if (pos / ps >= PyList_GET_SIZE(pl)) continue;        /* a short page list: page_table's */
                        ok = got == list_ll(pl, pos / ps, &bad) * ps + pos % ps && !bad;
                    } else if (tl != NULL) ok = got == list_ll(tl, pos, &bad) && !bad;
                }
            }
            break;
        case K_Q: case K_DIFF_Q:
            for (Py_ssize_t i = 0; i < b; i++) want[i] = r.cu_q[i + 1] - r.cu_q[i];
            if (kind == K_Q) ok = equal_to(&bc, want, b);
            else if (count(&bc) != b + 1) ok = 0;
            else
                for (Py_ssize_t i = 0; i < b && ok; i++) ok = ival(&bc, i + 1) - ival(&bc, i) == want[i];
            break;
        case K_CU_Q: ok = equal_to(&bc, r.cu_q, b + 1); break;
        case K_CTX: case K_ENDS_K: ok = equal_to(&bc, r.ctx, b); break;
        case K_CU_K: ok = equal_to(&bc, r.cu_k, b + 1); break;
        case K_ENDS_Q: ok = equal_to(&bc, r.cu_q + 1, b); break;
        }
        PyBuffer_Release(&bc);
        if (!ok) goto verdict;
    }
    clean = 1;
verdict:
    if (PyErr_Occurred()) PyErr_Clear();
    result = PyBool_FromLong(clean);
done:
    if (held_l) PyBuffer_Release(&bl);
    if (held_t) PyBuffer_Release(&bt);
    free(want);
    rows_free(&r);
    return result;
}

/* decode_plan(tok, rows, lens, tables, computed, scheduled, pages, page_size) -> bool
 *   tok, rows, lens  per query of the compiled decode kernel: its packed token, batch row, context length
 *   tables           the [R, W] table rows the kernel walks (int32 or int64), indexed by batch row
 * Clean: every batch row is one decode query at its own token with its own context length, and the
 * table row it walks holds its own pages over the columns its context reads (a page list shorter than
 * the context is page_table's to report, as in numpy). */
static PyObject *decode_plan(PyObject *self, PyObject *args) {
    PyObject *otok, *orows, *olens, *otab, *ocomp, *osched, *pages;
    long long ps;
    if (!PyArg_ParseTuple(args, "OOOOOOO!L", &otok, &orows, &olens, &otab, &ocomp, &osched, &PyList_Type, &pages, &ps))
        return NULL;
    if (ps <= 0) {
        PyErr_SetString(PyExc_ValueError, "packing: page_size must be positive");
        return NULL;
    }
    Rows r;
    Py_buffer b[4];
    int held = 0, clean = 0, bad = 0;
    char *seen = NULL;
    PyObject *result = NULL;
    const int st = rows_of(ocomp, osched, &r, "packing");
    if (st < 0) goto done;
    if (st > 0) goto verdict;
    PyObject *o[4] = {otok, orows, olens, otab};
    const char *what[4] = {"tok", "rows", "lens", "tables"};
    for (; held < 4; held++)
        if (hold(o[held], &b[held], 0, 0, "packing", what[held]) < 0) goto done;
    const Py_ssize_t nb = r.b, n = count(&b[0]);
    if (count(&b[1]) != n || count(&b[2]) != n || n != nb || PyList_GET_SIZE(pages) != nb) goto verdict;
    if (b[3].ndim != 2) goto verdict;
    const Py_ssize_t tr = b[3].shape[0], tw = b[3].shape[1];
    seen = calloc(nb ? nb : 1, 1);
    if (!seen) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        const int64_t row = ival(&b[1], k), tok = ival(&b[0], k);
        if (row < 0 || row >= nb || row >= tr || seen[row]) goto verdict;
        seen[row] = 1;
        if (r.cu_q[row + 1] - r.cu_q[row] < 1 || tok != r.cu_q[row] || ival(&b[2], k) != r.ctx[row]) goto verdict;
        PyObject *pl = PyList_GET_ITEM(pages, row);
        if (!PyList_Check(pl)) goto verdict;
        const int64_t need = (r.ctx[row] + ps - 1) / ps;
        if (PyList_GET_SIZE(pl) < need) continue;                   /* short: page_table's finding */
        const int64_t w = need < tw ? need : tw;
        for (int64_t c = 0; c < w; c++)
            if (ival(&b[3], row * tw + c) != list_ll(pl, c, &bad) || bad) goto verdict;
    }
    clean = 1;                                                      /* n == nb distinct rows: all covered */
verdict:
    if (PyErr_Occurred()) PyErr_Clear();
    result = PyBool_FromLong(clean);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    free(seen);
    rows_free(&r);
    return result;
}

static PyMethodDef methods[] = {
    {"batch", batch, METH_VARARGS, "batch(computed, scheduled, pages, token_ids, page_size, copies, max_q, max_k, "
                                   "logits, totals) -> True where every copy is the sequences' own"},
    {"decode_plan", decode_plan, METH_VARARGS, "decode_plan(tok, rows, lens, tables, computed, scheduled, pages, "
                                               "page_size) -> True where the decode plan is the sequences' own"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedkv_packing_check",
                                    "the packing probe's clean paths, compiled", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_pagedkv_packing_check(void) { return PyModule_Create(&module); }
