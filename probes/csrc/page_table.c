/* The page_table probe's two checks compiled, their clean paths (probes/page_table_native.py; the numpy
 * checks in probes/page_table.py are the reference, and report): the bound block table against the
 * sequences' page lists (every forward), and the live page tables against the pool (every step).
 *
 * table(): the bytes the kernels read (a host copy of the bound table) against each sequence's own page
 * list, over the columns each row's context reads: equal, inside the pool, no row that reads its context
 * from pages holding only zeros, no page list shorter than its context. One pass over [B, W] where numpy
 * built the reference table and took ~20 small operations at layer 0.
 *
 * scan(): the scan runs after every step, when the forward and the sampler have streamed the model
 * through the caches, and its ~30 small numpy operations each paid a cold dispatch (~270 us a step on
 * SmolLM2's workload A). A clean scan is one pass over the live page lists and one over the pool's
 * per-page arrays. Anything off (a page id outside the pool, a mapped page the pool holds free, a page
 * handed out again under a sequence, a refcount other than the number of live tables mapping the
 * page) returns None: the numpy scan then runs and names each finding. It reads the sequences' own
 * page lists and generations and the pool's raw arrays, never the pool's own accounting of them.
 */
#include "buffers.h"
#include <stdlib.h>
#include <string.h>

/* scan(page_lists, generation_lists, ref, generation, is_free) -> (mapped pages, shared pages) or None
 *   page_lists        the live sequences' page lists (lists of ints)
 *   generation_lists  theirs page_generations, in the same order (a list of another length than its
 *                     page list: no generation is compared, as the numpy scan does)
 *   ref, generation   the pool's per-page int64 arrays; is_free its per-page int8 flags
 * None: something is off, the numpy scan must look (it finds and reports what). */
static PyObject *scan(PyObject *self, PyObject *args) {
    PyObject *lists, *gens;
    PyObject *oref, *ogen, *ofree;
    if (!PyArg_ParseTuple(args, "O!O!OOO", &PyList_Type, &lists, &PyList_Type, &gens, &oref, &ogen, &ofree))
        return NULL;
    Py_buffer bref, bgen, bfree;
    if (hold(oref, &bref, 8, 0, "page_table", "ref") < 0) return NULL;
    if (hold(ogen, &bgen, 8, 0, "page_table", "generation") < 0) {
        PyBuffer_Release(&bref);
        return NULL;
    }
    if (hold(ofree, &bfree, 1, 0, "page_table", "is_free") < 0) {
        PyBuffer_Release(&bref);
        PyBuffer_Release(&bgen);
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = bref.len / 8, nl = PyList_GET_SIZE(lists);
    const int64_t *ref = bref.buf, *gen = bgen.buf;
    const int8_t *is_free = bfree.buf;
    int32_t *counts = NULL;
    Py_ssize_t mapped = 0, shared = 0;
    int compare_gens = 1;
    int off = bgen.len / 8 != n || bfree.len != n || PyList_GET_SIZE(gens) != nl;
    if (off) goto judged;
    for (Py_ssize_t i = 0; i < nl; i++) {
        PyObject *pl = PyList_GET_ITEM(lists, i), *gl = PyList_GET_ITEM(gens, i);
        if (!PyList_Check(pl) || !PyList_Check(gl)) {
            off = 1;
            goto judged;
        }
        if (PyList_GET_SIZE(gl) != PyList_GET_SIZE(pl)) compare_gens = 0;
    }
    counts = calloc((size_t)(n > 0 ? n : 1), sizeof(int32_t));
    if (!counts) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nl && !off; i++) {
        PyObject *pl = PyList_GET_ITEM(lists, i), *gl = PyList_GET_ITEM(gens, i);
        const Py_ssize_t m = PyList_GET_SIZE(pl);
        for (Py_ssize_t j = 0; j < m; j++) {
            long long p = PyLong_AsLongLong(PyList_GET_ITEM(pl, j));
            if (p == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                off = 1;                         /* not an int: the numpy scan says what */
                break;
            }
            if (p < 0 || p >= n || is_free[p]) {
                off = 1;
                break;
            }
            if (compare_gens) {
                long long g = PyLong_AsLongLong(PyList_GET_ITEM(gl, j));
                if ((g == -1 && PyErr_Occurred()) || g != gen[p]) {
                    PyErr_Clear();
                    off = 1;
                    break;
                }
            }
            counts[p]++;
            mapped++;
        }
    }
    for (Py_ssize_t p = 0; p < n && !off; p++) {
        if (counts[p] != ref[p]) off = 1;
        shared += counts[p] > 1;
    }
judged:
    if (off) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        result = Py_BuildValue("nn", mapped, shared);
    }
done:
    free(counts);
    PyBuffer_Release(&bref);
    PyBuffer_Release(&bgen);
    PyBuffer_Release(&bfree);
    return result;
}

/* table(read, computed, scheduled, pages, page_size, num_pages) -> bool: True where the numpy check
 * would find nothing (False: it must look, and it names what is off)
 *   read                 int64 [B, W]: the bound table's bytes, as the kernels read them
 *   computed, scheduled  [B] each row's tokens before the step and its chunk (its context: their sum)
 *   pages                each row's own page list
 * Over the columns each row's context reads: the page its own list puts there, inside the pool; no
 * page list shorter than the context, no table narrower than it, no row that reads its context from
 * pages holding only zeros. The table the sequences mean is walked row by row, never built. */
static PyObject *table(PyObject *self, PyObject *args) {
    PyObject *oread, *ocomp, *osched, *pages;
    long long ps, num_pages;
    if (!PyArg_ParseTuple(args, "OOOO!LL", &oread, &ocomp, &osched, &PyList_Type, &pages, &ps, &num_pages)) return NULL;
    if (ps <= 0) {
        PyErr_SetString(PyExc_ValueError, "page_table: page_size must be positive");
        return NULL;
    }
    Py_buffer b[3];
    PyObject *o[3] = {oread, ocomp, osched};
    const Py_ssize_t size[3] = {8, 0, 0};
    const char *what[3] = {"read", "computed", "scheduled"};
    int held = 0;
    PyObject *result = NULL;
    for (; held < 3; held++)
        if (hold(o[held], &b[held], size[held], 0, "page_table", what[held]) < 0) goto done;
    const Py_ssize_t B = count(&b[1]);
    int clean = b[0].ndim == 2 && b[0].shape[0] == B && count(&b[2]) == B && PyList_GET_SIZE(pages) == B;
    const Py_ssize_t W = clean ? b[0].shape[1] : 0;
    const int64_t *read = b[0].buf;
    for (Py_ssize_t r = 0; r < B && clean; r++) {
        const int64_t c0 = ival(&b[1], r), q = ival(&b[2], r), ctx = c0 + q;
        PyObject *pl = PyList_GET_ITEM(pages, r);
        const int64_t k = ctx > 0 ? (ctx + ps - 1) / ps : 0;
        if (c0 < 0 || q < 0 || !PyList_Check(pl) || PyList_GET_SIZE(pl) < k || k > W) {   /* short, narrow */
            clean = 0;
            break;
        }
        int any = 0, bad = 0;
        for (Py_ssize_t c = 0; c < k; c++) {
            const int64_t p = read[r * W + c];
            if (p != list_ll(pl, c, &bad) || bad || p < 0 || p >= num_pages) {
                clean = 0;
                break;
            }
            any |= p != 0;
        }
        if (clean && !any && ctx > q) clean = 0;      /* reads pages, all zero: numpy judges the row */
    }
    result = PyBool_FromLong(clean);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"table", table, METH_VARARGS, "table(read, computed, scheduled, pages, page_size, num_pages) -> "
                                   "True where the bound table is clean"},
    {"scan", scan, METH_VARARGS, "scan(page_lists, generation_lists, ref, generation, is_free) -> "
                                 "(mapped pages, shared pages), or None where something is off"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedkv_page_table_check",
                                    "the page_table probe's clean paths, compiled", -1, methods, NULL, NULL, NULL,
                                    NULL};

PyMODINIT_FUNC PyInit_pagedkv_page_table_check(void) { return PyModule_Create(&module); }
