/* The scheduler's and simulator's per-sequence loops, compiled: the twin of seq_ops.py.
 *
 * A replay of a production trace runs ~250 sequences through these two loops every step, for
 * ~90k steps; in Python that was a third of its time. Same arguments, same results, same
 * attribute writes as the Python reference (seq_ops.py; tests/test_seq_ops.py runs both).
 * They read the sequences' own attributes through the normal attribute protocol, so a
 * property (Sequence.num_tokens) works as it does in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_computed, *s_tokens, *s_pages, *s_hashes, *s_output, *s_first, *s_stop;

static int get_int(PyObject *o, PyObject *name, Py_ssize_t *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    Py_ssize_t x = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

static int get_len(PyObject *o, PyObject *name, Py_ssize_t *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    Py_ssize_t n = PyObject_Length(v);
    Py_DECREF(v);
    if (n < 0) return -1;
    *out = n;
    return 0;
}

static int set_int(PyObject *o, PyObject *name, Py_ssize_t x) {
    PyObject *v = PyLong_FromSsize_t(x);
    if (v == NULL) return -1;
    int rc = PyObject_SetAttr(o, name, v);
    Py_DECREF(v);
    return rc;
}

static int append_pair(PyObject *out, PyObject *seq, Py_ssize_t n) {
    PyObject *pair = Py_BuildValue("(On)", seq, n);
    if (pair == NULL) return -1;
    int rc = PyList_Append(out, pair);
    Py_DECREF(pair);
    return rc;
}

/* fit_running(running, i, budget, page_size, out) -> (i, budget) */
static PyObject *fit_running(PyObject *self, PyObject *args) {
    PyObject *running, *out;
    Py_ssize_t i, budget, ps;
    if (!PyArg_ParseTuple(args, "O!nnnO!", &PyList_Type, &running, &i, &budget, &ps, &PyList_Type, &out))
        return NULL;
    while (i < PyList_GET_SIZE(running) && budget > 0) {
        PyObject *seq = PyList_GET_ITEM(running, i);
        Py_INCREF(seq);                      /* an attribute read may run Python code */
        Py_ssize_t c, nt, np;
        if (get_int(seq, s_computed, &c) < 0 || get_int(seq, s_tokens, &nt) < 0 || get_len(seq, s_pages, &np) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        Py_ssize_t n = nt - c;
        if (n > budget) n = budget;
        if (c + n > np * ps) {               /* needs pages: the caller grows or preempts */
            Py_DECREF(seq);
            break;
        }
        int rc = append_pair(out, seq, n);
        Py_DECREF(seq);
        if (rc < 0) return NULL;
        budget -= n;
        i++;
    }
    return Py_BuildValue("nn", i, budget);
}

/* advance(scheduled, page_size, register, clock, produced, special) -> None; special gets (seq, done) */
static PyObject *advance(PyObject *self, PyObject *args) {
    PyObject *scheduled, *produced, *special;
    Py_ssize_t ps;
    int reg;
    double clock;
    if (!PyArg_ParseTuple(args, "O!npdO!O!", &PyList_Type, &scheduled, &ps, &reg, &clock, &PyList_Type, &produced,
                          &PyList_Type, &special))
        return NULL;
    if (ps < 1) {
        PyErr_SetString(PyExc_ValueError, "seq_ops.advance: page_size must be >= 1");
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(scheduled);
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *pair = PyList_GET_ITEM(scheduled, j);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "seq_ops.advance: scheduled holds (sequence, tokens) pairs");
            return NULL;
        }
        PyObject *seq = PyTuple_GET_ITEM(pair, 0);
        Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
        if (n == -1 && PyErr_Occurred()) return NULL;
        Py_ssize_t c0, nt;
        if (get_int(seq, s_computed, &c0) < 0) return NULL;
        Py_ssize_t c = c0 + n;
        if (set_int(seq, s_computed, c) < 0) return NULL;
        int filled = 0, done = 0;
        if (reg) {
            Py_ssize_t nh;
            if (get_len(seq, s_hashes, &nh) < 0) return NULL;
            filled = c / ps > nh;
        }
        if (get_int(seq, s_tokens, &nt) < 0) return NULL;
        if (c == nt) {
            Py_ssize_t out, stop;
            if (set_int(seq, s_tokens, c + 1) < 0 || get_int(seq, s_output, &out) < 0
                || set_int(seq, s_output, out + 1) < 0)
                return NULL;
            PyObject *first = PyObject_GetAttr(seq, s_first);
            if (first == NULL) return NULL;
            int none = first == Py_None;
            Py_DECREF(first);
            if (none) {
                PyObject *t = PyFloat_FromDouble(clock);
                if (t == NULL) return NULL;
                int rc = PyObject_SetAttr(seq, s_first, t);
                Py_DECREF(t);
                if (rc < 0) return NULL;
            }
            if (get_int(seq, s_stop, &stop) < 0) return NULL;
            done = c + 1 >= stop;
            if (PyList_Append(produced, seq) < 0) return NULL;
        }
        if ((filled || done) && append_pair(special, seq, done) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* mapped(running, page_size) -> (waste, pages): slots left empty in the running sequences' last
 * pages, and the pages they map */
static PyObject *mapped(PyObject *self, PyObject *args) {
    PyObject *running;
    Py_ssize_t ps;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &running, &ps)) return NULL;
    if (ps < 1) {
        PyErr_SetString(PyExc_ValueError, "seq_ops.mapped: page_size must be >= 1");
        return NULL;
    }
    Py_ssize_t waste = 0, pages = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(running); i++) {
        PyObject *seq = PyList_GET_ITEM(running, i);
        Py_INCREF(seq);
        Py_ssize_t c, np;
        int rc = get_int(seq, s_computed, &c) < 0 || get_len(seq, s_pages, &np) < 0;
        Py_DECREF(seq);
        if (rc) return NULL;
        Py_ssize_t r = (-c) % ps;             /* Python's -c % ps: C's % keeps the dividend's sign */
        waste += r < 0 ? r + ps : r;
        pages += np;
    }
    return Py_BuildValue("nn", waste, pages);
}

static int pair_at(PyObject *scheduled, Py_ssize_t j, PyObject **seq, Py_ssize_t *n) {
    PyObject *pair = PyList_GET_ITEM(scheduled, j);
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_SetString(PyExc_TypeError, "seq_ops: scheduled holds (sequence, tokens) pairs");
        return -1;
    }
    *seq = PyTuple_GET_ITEM(pair, 0);
    *n = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
    return *n == -1 && PyErr_Occurred() ? -1 : 0;
}

/* token_counts(scheduled) -> (tokens, prefill tokens: those of rows with more than one) */
static PyObject *token_counts(PyObject *self, PyObject *args) {
    PyObject *scheduled, *seq;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &scheduled)) return NULL;
    Py_ssize_t total = 0, pre = 0, n;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(scheduled); j++) {
        if (pair_at(scheduled, j, &seq, &n) < 0) return NULL;
        total += n;
        if (n > 1) pre += n;
    }
    return Py_BuildValue("nn", total, pre);
}

static PyObject *s_rid;

/* packed_columns(scheduled) -> (request ids, tokens, context after the step), three tuples */
static PyObject *packed_columns(PyObject *self, PyObject *args) {
    PyObject *scheduled, *seq;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &scheduled)) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(scheduled), n, c;
    PyObject *rids = PyTuple_New(k), *q = PyTuple_New(k), *ctx = PyTuple_New(k);
    if (rids == NULL || q == NULL || ctx == NULL) goto fail;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (pair_at(scheduled, j, &seq, &n) < 0) goto fail;
        PyObject *rid = PyObject_GetAttr(seq, s_rid);
        if (rid == NULL) goto fail;
        PyTuple_SET_ITEM(rids, j, rid);
        PyObject *nobj = PyTuple_GET_ITEM(PyList_GET_ITEM(scheduled, j), 1);
        Py_INCREF(nobj);
        PyTuple_SET_ITEM(q, j, nobj);
        if (get_int(seq, s_computed, &c) < 0) goto fail;
        PyObject *cobj = PyLong_FromSsize_t(c + n);
        if (cobj == NULL) goto fail;
        PyTuple_SET_ITEM(ctx, j, cobj);
    }
    return Py_BuildValue("(NNN)", rids, q, ctx);
fail:
    Py_XDECREF(rids);
    Py_XDECREF(q);
    Py_XDECREF(ctx);
    return NULL;
}

static PyMethodDef methods[] = {
    {"fit_running", fit_running, METH_VARARGS, "Schedule running sequences whose tokens fit their pages."},
    {"token_counts", token_counts, METH_VARARGS, "Tokens and prefill tokens of a schedule."},
    {"packed_columns", packed_columns, METH_VARARGS, "A schedule's request ids, tokens and contexts."},
    {"mapped", mapped, METH_VARARGS, "Empty slots in last pages and pages mapped (see seq_ops.mapped)."},
    {"advance", advance, METH_VARARGS, "Advance a simulated step's sequences (see seq_ops.advance)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedkv_seq_ops", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_pagedkv_seq_ops(void) {
    s_computed = PyUnicode_InternFromString("num_computed_tokens");
    s_tokens = PyUnicode_InternFromString("num_tokens");
    s_pages = PyUnicode_InternFromString("pages");
    s_hashes = PyUnicode_InternFromString("page_hashes");
    s_output = PyUnicode_InternFromString("num_output");
    s_first = PyUnicode_InternFromString("first_token_time");
    s_stop = PyUnicode_InternFromString("stop_at");
    s_rid = PyUnicode_InternFromString("request_id");
    if (!s_rid || !s_computed || !s_tokens || !s_pages || !s_hashes || !s_output || !s_first || !s_stop) return NULL;
    return PyModule_Create(&module);
}
