/* What the probes' compiled clean paths share: holding a numpy array's memory for the length of a call,
 * and reading its integers whatever their width. Included by attention_check.c's neighbours in this
 * directory (page_table.c, page_writes.c, packing.c); the kernels loader hashes it with each of them. */
#ifndef PAGEDKV_PROBE_BUFFERS_H
#define PAGEDKV_PROBE_BUFFERS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* b over o's memory (C-contiguous), items of `itemsize` bytes (0: 4 or 8, signed integers), writable when
 * asked; on failure nothing is held and a TypeError names the array (the caller lets numpy read it) */
static inline int hold(PyObject *o, Py_buffer *b, Py_ssize_t itemsize, int writable, const char *who,
                       const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    const char f = b->format ? b->format[b->format[0] == '<' || b->format[0] == '=' || b->format[0] == '@'] : 'B';
    const int ints = f == 'q' || f == 'l' || f == 'i' || f == 'b' || f == 'n';
    if ((itemsize && b->itemsize != itemsize) || (!itemsize && (!ints || (b->itemsize != 4 && b->itemsize != 8)))) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_TypeError, "%s: %s must hold %s", who, what,
                     itemsize ? "items of the expected width" : "4- or 8-byte signed integers");
        return -1;
    }
    return 0;
}

/* item i of a held buffer of 4- or 8-byte signed integers */
static inline int64_t ival(const Py_buffer *b, Py_ssize_t i) {
    return b->itemsize == 8 ? ((const int64_t *)b->buf)[i] : (int64_t)((const int32_t *)b->buf)[i];
}

/* the int at list[i] (a Python list), or -1 with *bad set where it is not an int that fits int64: the
 * caller then answers "look" and numpy reads (and reports) the list */
static inline long long list_ll(PyObject *list, Py_ssize_t i, int *bad) {
    PyObject *o = PyList_GET_ITEM(list, i);
    long long v = PyLong_Check(o) ? PyLong_AsLongLong(o) : -1;
    if (!PyLong_Check(o) || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *bad = 1;
    }
    return v;
}

/* items in a held buffer */
static inline Py_ssize_t count(const Py_buffer *b) { return b->len / b->itemsize; }

#endif
