/* The page write ledger's step compiled, its clean path (probes/page_writes_native.py; the numpy
 * PageWriteLedger.step in probes/page_writes.py is the reference, and reports).
 *
 * One step of the ledger: each row's prefix digests over the positions it has not digested yet, the
 * positions it holds without having computed them (its prefix-cache hits) checked against the digest
 * last written to the slot its own page list names, then this step's writes recorded at the slots the
 * kernel was handed and each row's running digest kept. In numpy that is ~30 small operations after
 * every step (~0.35 ms a step on SmolLM2's workload A, each a cold dispatch after the sampler); here
 * one pass over the rows.
 *
 * Clean or look: every check runs before anything is written. A hit that disagrees with the ledger, or
 * anything this code does not read as the engine's own types (a request id that is not an int, token
 * ids or a page list that are not lists of ints, a state entry of another shape), returns None with the
 * ledger untouched: the numpy step then runs, records the step and names the mismatch.
 *
 * The digest: D(n) = B**n * S(n), S(n) = seed + sum_{k<=n} (t_k + 1) * B**-k, all mod 2**64 (unsigned
 * arithmetic wraps as numpy's uint64 does).
 */
#include "buffers.h"
#include <stdlib.h>

#define BASE 0x100000001B3ULL                  /* FNV-64's prime, as page_writes._BASE */

static uint64_t pow_mod(uint64_t b, uint64_t e) {   /* b**e mod 2**64 */
    uint64_t r = 1;
    while (e) {
        if (e & 1) r *= b;
        b *= b;
        e >>= 1;
    }
    return r;
}

static uint64_t base_inv(void) {                /* B**-1 mod 2**64 (Newton's iteration; B is odd) */
    uint64_t x = BASE;
    for (int i = 0; i < 6; i++) x *= 2 - BASE * x;
    return x;
}

typedef struct {
    PyObject *rid, *tokens;                     /* borrowed from the row tuple */
    long long id, c, n, done, end;
    uint64_t s_end;                             /* S through end - 1 */
    Py_ssize_t dig;                             /* where its write digests start in the step's buffer */
    int skip;                                   /* nothing to digest (end <= done) */
} Row;

/* step(rows, slot_mapping, state, seed, writer, pos, tok, digest, page_size, strict, before)
 *   -> (verified [(request, lo, hi)], positions checked, slots written, pages written), or None
 *   rows          per batch row (request id, token ids, computed before the step, scheduled, page list)
 *   slot_mapping  the int64 slots the kernel was handed, or None (nothing recorded)
 *   state         request -> (positions digested, S through them): read, and updated on a clean step
 *   writer, pos, tok (int64), digest (uint64): the ledger's per-slot arrays, written on a clean step
 *   before        None, or an int64 array as long as slot_mapping: filled with the writer each slot held
 *                 before this step (-1: none, or a slot outside the ledger), for the index audit
 * pages written: the distinct pages this step wrote (first seen first), for the index audit. */
static PyObject *step(PyObject *self, PyObject *args) {
    PyObject *rows, *osm, *state, *ow, *op, *ot, *od, *obefore = Py_None;
    unsigned long long seed;
    long long ps;
    int strict;
    if (!PyArg_ParseTuple(args, "O!OO!KOOOOLp|O", &PyList_Type, &rows, &osm, &PyDict_Type, &state, &seed, &ow,
                          &op, &ot, &od, &ps, &strict, &obefore))
        return NULL;
    if (ps <= 0) {
        PyErr_SetString(PyExc_ValueError, "page_writes: page_size must be positive");
        return NULL;
    }
    Py_buffer b[6];
    int held = 0;
    PyObject *result = NULL, *verified = NULL, *pages_out = NULL;
    Row *rs = NULL;
    uint64_t *digs = NULL;
    if (osm == Py_None && obefore != Py_None) {
        PyErr_SetString(PyExc_ValueError, "page_writes: before needs a slot_mapping");
        return NULL;
    }
    PyObject *objs[6] = {ow, op, ot, od, osm, obefore};
    const char *names[6] = {"writer", "pos", "tok", "digest", "slot_mapping", "before"};
    const int nbuf = osm == Py_None ? 4 : obefore == Py_None ? 5 : 6;
    for (; held < nbuf; held++)
        if (hold(objs[held], &b[held], 8, held < 4 || held == 5, "page_writes", names[held]) < 0) goto done;
    int64_t *writer = b[0].buf, *pos = b[1].buf, *tok = b[2].buf;
    uint64_t *digest = b[3].buf;
    const Py_ssize_t nslots = b[0].len / 8;
    if (b[1].len / 8 != nslots || b[2].len / 8 != nslots || b[3].len / 8 != nslots) {
        PyErr_SetString(PyExc_ValueError, "page_writes: the ledger's arrays differ in length");
        goto done;
    }
    const int64_t *sm = nbuf >= 5 ? b[4].buf : NULL;
    const Py_ssize_t nsm = nbuf >= 5 ? b[4].len / 8 : 0;
    int64_t *before = nbuf == 6 ? b[5].buf : NULL;
    if (before != NULL && b[5].len / 8 != nsm) {
        PyErr_SetString(PyExc_ValueError, "page_writes: before must be as long as slot_mapping");
        goto done;
    }
    const Py_ssize_t nr = PyList_GET_SIZE(rows);
    rs = calloc(nr ? nr : 1, sizeof(Row));
    if (!rs) {
        PyErr_NoMemory();
        goto done;
    }
    verified = PyList_New(0);
    if (!verified) goto done;
    const uint64_t inv = base_inv();
    Py_ssize_t total = 0;
    long long checked = 0;
    int bad = 0;
    /* ---- pass 1: parse, digest, check the hits; nothing written */
    for (Py_ssize_t i = 0; i < nr && !bad; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 5) goto look;
        Row *r = &rs[i];
        r->rid = PyTuple_GET_ITEM(row, 0);
        r->tokens = PyTuple_GET_ITEM(row, 1);
        PyObject *oc = PyTuple_GET_ITEM(row, 2), *on = PyTuple_GET_ITEM(row, 3), *opg = PyTuple_GET_ITEM(row, 4);
        if (!PyLong_Check(r->rid) || !PyLong_Check(oc) || !PyLong_Check(on) || !PyList_Check(r->tokens) ||
            !PyList_Check(opg))
            goto look;
        r->id = PyLong_AsLongLong(r->rid);
        r->c = PyLong_AsLongLong(oc);
        r->n = PyLong_AsLongLong(on);
        if (PyErr_Occurred() || r->c < 0 || r->n < 0) {
            PyErr_Clear();
            goto look;
        }
        long long done_ = 0;
        uint64_t s = seed;
        PyObject *st = PyDict_GetItemWithError(state, r->rid);
        if (st) {
            if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) != 2 || !PyLong_Check(PyTuple_GET_ITEM(st, 0)) ||
                !PyLong_Check(PyTuple_GET_ITEM(st, 1)))
                goto look;
            done_ = PyLong_AsLongLong(PyTuple_GET_ITEM(st, 0));
            s = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(st, 1));
            if (PyErr_Occurred()) {
                PyErr_Clear();
                goto look;
            }
        } else if (PyErr_Occurred()) {
            PyErr_Clear();
            goto look;
        }
        if (r->c < done_) {                     /* recomputed from a preemption (or a repage) */
            done_ = 0;
            s = seed;
        }
        r->done = done_;
        r->end = r->c + r->n;
        if (r->end <= done_) {
            r->skip = 1;
            continue;
        }
        if (PyList_GET_SIZE(r->tokens) < r->end) goto look;
        r->dig = total;
        total += r->n;
        uint64_t fwd = pow_mod(BASE, (uint64_t)done_), iv = pow_mod(inv, (uint64_t)done_);
        const Py_ssize_t npg = PyList_GET_SIZE(opg);
        const int check = done_ < r->c && r->c <= npg * ps;      /* a short page list: page_table's finding */
        for (long long p = done_; p < r->c; p++) {               /* the hit: digests checked, not kept */
            long long t = list_ll(r->tokens, p, &bad);
            s += (uint64_t)(t + 1) * iv;
            const uint64_t d = fwd * s;
            fwd *= BASE;
            iv *= inv;
            if (!check) continue;
            long long page = list_ll(opg, p / ps, &bad);
            long long slot = page * ps + p % ps;
            if (bad) break;
            if (slot < 0 || slot >= nslots) continue;
            const int known = writer[slot] >= 0;
            checked += known;
            if ((known || strict) && digest[slot] != d) bad = 1;     /* numpy names it */
        }
        if (bad) break;
        if (check) {
            PyObject *v = Py_BuildValue("(OLL)", r->rid, done_, r->c);
            if (!v || PyList_Append(verified, v) < 0) {
                Py_XDECREF(v);
                goto done;
            }
            Py_DECREF(v);
        }
        r->s_end = s;                           /* the write digests come in pass 2 (buffer sized by then) */
    }
    if (bad) goto look;
    /* ---- pass 2: the step's own digests, the writes, the running digests */
    digs = malloc((total ? total : 1) * sizeof(uint64_t));
    if (!digs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        Row *r = &rs[i];
        if (r->skip) continue;
        uint64_t s = r->s_end, fwd = pow_mod(BASE, (uint64_t)r->c), iv = pow_mod(inv, (uint64_t)r->c);
        for (long long p = r->c; p < r->end; p++) {
            long long t = list_ll(r->tokens, p, &bad);
            s += (uint64_t)(t + 1) * iv;
            digs[r->dig + (p - r->c)] = fwd * s;
            fwd *= BASE;
            iv *= inv;
        }
        if (bad) goto look;
        r->s_end = s;
    }
    long long written = 0;
    pages_out = PyList_New(0);
    if (!pages_out) goto done;
    if (before != NULL)                         /* who held every slot of the mapping before the writes */
        for (Py_ssize_t j = 0; j < nsm; j++) before[j] = sm[j] >= 0 && sm[j] < nslots ? writer[sm[j]] : -1;
    if (sm != NULL && nsm >= total) {
        long long last_page = -1;
        for (Py_ssize_t i = 0; i < nr; i++) {
            Row *r = &rs[i];
            if (r->skip) continue;
            for (long long j = 0; j < r->n; j++) {
                const int64_t sl = sm[r->dig + j];
                if (sl < 0 || sl >= nslots) continue;
                writer[sl] = r->id;
                pos[sl] = r->c + j;
                tok[sl] = PyLong_AsLongLong(PyList_GET_ITEM(r->tokens, r->c + j));   /* ints: pass 2 read them */
                digest[sl] = digs[r->dig + j];
                written++;
                const long long page = sl / ps;
                if (page != last_page) {        /* a step writes runs of one page: most repeats end here */
                    PyObject *pg = PyLong_FromLongLong(page);
                    int has = pg ? PySequence_Contains(pages_out, pg) : -1;
                    if (has == 0) has = PyList_Append(pages_out, pg);
                    Py_XDECREF(pg);
                    if (has < 0) goto done;
                    last_page = page;
                }
            }
        }
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        Row *r = &rs[i];
        if (r->skip) continue;
        PyObject *v = Py_BuildValue("(LK)", r->end, (unsigned long long)r->s_end);
        if (!v || PyDict_SetItem(state, r->rid, v) < 0) {
            Py_XDECREF(v);
            goto done;
        }
        Py_DECREF(v);
    }
    result = Py_BuildValue("(OLLO)", verified, checked, written, pages_out);
    goto done;
look:
    if (PyErr_Occurred()) PyErr_Clear();
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    free(rs);
    free(digs);
    Py_XDECREF(verified);
    Py_XDECREF(pages_out);
    return result;
}

static PyMethodDef methods[] = {
    {"step", step, METH_VARARGS, "step(rows, slot_mapping, state, seed, writer, pos, tok, digest, page_size, strict[, before]) "
                                 "-> (verified, positions checked, slots written, pages written), or None: look"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedkv_page_writes",
                                    "the page write ledger's clean step, compiled", -1, methods, NULL, NULL, NULL,
                                    NULL};

PyMODINIT_FUNC PyInit_pagedkv_page_writes(void) { return PyModule_Create(&module); }
