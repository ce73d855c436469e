/* The page_table probe's scan of the live page tables against the pool, compiled: its clean path
 * (probes/page_scan.py; the numpy scan in probes/page_table.py is the reference, and reports).
 *
 * Why C: the scan runs after every step, when the forward and the sampler have streamed the model
 * through the caches, and its ~30 small numpy operations each paid a cold dispatch (~270 us a step on
 * SmolLM2's workload A). A clean scan is one pass over the live page lists and one over the pool's
 * per-page arrays. Anything off (a page id outside the pool, a mapped page the pool holds free, a page
 * handed out again under a sequence, a refcount other than the number of live tables mapping the
 * page) returns None: the numpy scan then runs and names each finding. It reads the sequences' own
 * page lists and generations and the pool's raw arrays, never the pool's own accounting of them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int hold(PyObject *o, Py_buffer *b, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (b->itemsize != itemsize) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_TypeError, "page_scan: %s must hold %zd-byte items", what, itemsize);
        return -1;
    }
    return 0;
}

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
    if (hold(oref, &bref, 8, "ref") < 0) return NULL;
    if (hold(ogen, &bgen, 8, "generation") < 0) {
        PyBuffer_Release(&bref);
        return NULL;
    }
    if (hold(ofree, &bfree, 1, "is_free") < 0) {
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

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "scan(page_lists, generation_lists, ref, generation, is_free) -> "
                                 "(mapped pages, shared pages), or None where something is off"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedkv_page_scan",
                                    "the page_table probe's clean scan, compiled", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_pagedkv_page_scan(void) { return PyModule_Create(&module); }
