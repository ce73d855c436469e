/* The page pool's per-page loops, compiled: the twin of pool_ops.py's Python functions.
 *
 * Same arguments, same results, same state left behind (pool_ops.py is the reference,
 * tests/test_page_pool.py runs the pool on both). They work in place on the PagePool's own
 * arrays, lists and dict, so everything that reads the pool (probes, views, faults) sees one
 * representation. Page ids read from them are bounds-checked: a corrupt queue raises, it never
 * reads out of range.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>


static int check_lists(PyObject **lists, int k, Py_ssize_t *n) {
    *n = PyList_GET_SIZE(lists[0]);
    for (int i = 1; i < k; i++)
        if (PyList_GET_SIZE(lists[i]) != *n) {
            PyErr_SetString(PyExc_ValueError, "pool_ops: the pool's per-page lists differ in length");
            return -1;
        }
    return 0;
}

static inline void put(PyObject *list, Py_ssize_t i, PyObject *v) {   /* list[i] = v (v borrowed) */
    PyObject *old = PyList_GET_ITEM(list, i);
    Py_INCREF(v);
    PyList_SET_ITEM(list, i, v);
    Py_XDECREF(old);
}

/* The per-page integers (links, refcounts, generations, free flags) live in array.array('q') /
 * array.array('b'): read and written here in place through the buffer protocol. */
typedef struct {
    Py_buffer v;
    int held;
} buf_t;

static int hold(PyObject *o, buf_t *b, char fmt, const char *what) {
    b->held = 0;
    if (PyObject_GetBuffer(o, &b->v, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    b->held = 1;
    Py_ssize_t want = fmt == 'q' ? 8 : 1;
    if (b->v.itemsize != want || b->v.format == NULL || b->v.format[0] != fmt || b->v.format[1] != 0) {
        PyErr_Format(PyExc_TypeError, "pool_ops: %s must be an array.array('%c')", what, fmt);
        return -1;
    }
    return 0;
}

static void let_go(buf_t *bufs, int k) {
    for (int i = 0; i < k; i++)
        if (bufs[i].held) PyBuffer_Release(&bufs[i].v);
}

/* take(nxt, prv, is_free, page_hash, page_tokens, page_index, page_parent, generation, ref, cached, ids, head, n)
 *   -> (pages, generations, evicted, head); ids[p] is page p's int object (shared, never re-created) */
static PyObject *take(PyObject *self, PyObject *args) {
    PyObject *onxt, *oprv, *ofree, *ogen, *oref, *oindex, *L[4], *cached;
    long head;
    Py_ssize_t k, n, nl;
    if (!PyArg_ParseTuple(args, "OOOO!O!OO!OOO!O!ln", &onxt, &oprv, &ofree, &PyList_Type, &L[0], &PyList_Type,
                          &L[1], &oindex, &PyList_Type, &L[2], &ogen, &oref, &PyDict_Type, &cached, &PyList_Type,
                          &L[3], &head, &k))
        return NULL;
    PyObject *page_hash = L[0], *tokens = L[1], *parent = L[2];
    buf_t B[6];
    memset(B, 0, sizeof B);
    PyObject *pages = NULL, *gens = NULL, *evicted = NULL, *ids = L[3];
    if (hold(onxt, &B[0], 'q', "nxt") < 0 || hold(oprv, &B[1], 'q', "prv") < 0 ||
        hold(ofree, &B[2], 'b', "is_free") < 0 || hold(ogen, &B[3], 'q', "generation") < 0 ||
        hold(oref, &B[4], 'q', "ref") < 0 || hold(oindex, &B[5], 'q', "page_index") < 0)
        goto fail;
    n = B[0].v.len / 8;
    if (B[1].v.len / 8 != n || B[2].v.len != n || B[3].v.len / 8 != n || B[4].v.len / 8 != n ||
        B[5].v.len / 8 != n || check_lists(L, 4, &nl) < 0 || nl != n) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "pool_ops: the pool's per-page arrays differ in length");
        goto fail;
    }
    long long *nxt = B[0].v.buf, *prv = B[1].v.buf, *gen = B[3].v.buf, *ref = B[4].v.buf, *index = B[5].v.buf;
    signed char *is_free = B[2].v.buf;
    if (k < 0) k = 0;
    pages = PyList_New(k);
    gens = PyList_New(k);
    evicted = PyList_New(0);
    if (pages == NULL || gens == NULL || evicted == NULL) goto fail;
    long long p = head;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (p < 0 || p >= n) {
            PyErr_Format(PyExc_RuntimeError, "pool_ops: the free queue ends after %zd of %zd pages", i, k);
            goto fail;
        }
        long long q = nxt[p];
        if (q < -1 || q >= n) {
            PyErr_Format(PyExc_IndexError, "pool_ops: the free queue links to page %lld, outside the pool", q);
            goto fail;
        }
        nxt[p] = prv[p] = -1;
        is_free[p] = 0;
        PyObject *pobj = PyList_GET_ITEM(ids, p);
        Py_INCREF(pobj);
        PyList_SET_ITEM(pages, i, pobj);                       /* steals the new reference */
        if (PyList_GET_ITEM(page_hash, p) != Py_None && PyList_Append(evicted, pobj) < 0) goto fail;
        gen[p] += 1;
        ref[p] = 1;
        PyObject *g = PyLong_FromLongLong(gen[p]);
        if (g == NULL) goto fail;
        PyList_SET_ITEM(gens, i, g);
        p = q;
    }
    if (p != -1) prv[p] = -1;
    Py_ssize_t nev = PyList_GET_SIZE(evicted);
    for (Py_ssize_t i = 0; i < nev; i++) {  /* a cached page handed out loses its hash */
        /* Evicted pages are scattered (LRU order): fetch the list slots 8 pages ahead and the
         * objects they hold 4 ahead, so the cache misses overlap instead of queueing. */
        if (i + 8 < nev) {
            Py_ssize_t f = PyLong_AsSsize_t(PyList_GET_ITEM(evicted, i + 8));
            if (f >= 0 && f < n) {
                __builtin_prefetch(&PyList_GET_ITEM(page_hash, f));
                __builtin_prefetch(&PyList_GET_ITEM(tokens, f));
                __builtin_prefetch(&PyList_GET_ITEM(parent, f));
            }
        }
        if (i + 4 < nev) {
            Py_ssize_t f = PyLong_AsSsize_t(PyList_GET_ITEM(evicted, i + 4));
            if (f >= 0 && f < n) {
                __builtin_prefetch(PyList_GET_ITEM(page_hash, f));
                __builtin_prefetch(PyList_GET_ITEM(tokens, f));
                __builtin_prefetch(PyList_GET_ITEM(parent, f));
            }
        }
        PyObject *pobj = PyList_GET_ITEM(evicted, i);
        Py_ssize_t e = PyLong_AsSsize_t(pobj);
        PyObject *h = PyList_GET_ITEM(page_hash, e);
        Py_INCREF(h);
        PyObject *v = PyDict_GetItemWithError(cached, h);
        int same = 0;
        if (v == NULL && PyErr_Occurred()) { Py_DECREF(h); goto fail; }
        if (v != NULL) {
            same = PyObject_RichCompareBool(v, pobj, Py_EQ);
            if (same < 0 || (same && PyDict_DelItem(cached, h) < 0)) { Py_DECREF(h); goto fail; }
        }
        Py_DECREF(h);
        put(page_hash, e, Py_None);
        put(tokens, e, Py_None);
        put(parent, e, Py_None);
        index[e] = -1;
    }
    let_go(B, 6);
    return Py_BuildValue("(NNNL)", pages, gens, evicted, p);
fail:
    let_go(B, 6);
    Py_XDECREF(pages);
    Py_XDECREF(gens);
    Py_XDECREF(evicted);
    return NULL;
}

/* release(ref, nxt, prv, is_free, page_hash, pages, head, tail)
 *   -> (released, still, cached, head, tail, error): error None, or the exception the Python loop
 *   raises (a refcount <= 0, a page outside the pool), to be raised once the caller kept its books */
static PyObject *release(PyObject *self, PyObject *args) {
    PyObject *oref, *onxt, *oprv, *ofree, *L[1], *pages_in;
    long head, tail;
    Py_ssize_t n, nl;
    if (!PyArg_ParseTuple(args, "OOOOO!Oll", &oref, &onxt, &oprv, &ofree, &PyList_Type, &L[0], &pages_in, &head,
                          &tail))
        return NULL;
    PyObject *page_hash = L[0];
    buf_t B[4];
    memset(B, 0, sizeof B);
    PyObject *released = NULL, *still = NULL, *cached = NULL, *it = NULL, *item = NULL, *error = NULL;
    if (hold(oref, &B[0], 'q', "ref") < 0 || hold(onxt, &B[1], 'q', "nxt") < 0 || hold(oprv, &B[2], 'q', "prv") < 0 ||
        hold(ofree, &B[3], 'b', "is_free") < 0)
        goto fail;
    n = B[0].v.len / 8;
    if (B[1].v.len / 8 != n || B[2].v.len / 8 != n || B[3].v.len != n || check_lists(L, 1, &nl) < 0 || nl != n) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "pool_ops: the pool's per-page arrays differ in length");
        goto fail;
    }
    if (head < -1 || head >= n || tail < -1 || tail >= n) {
        PyErr_Format(PyExc_IndexError, "pool_ops: the free queue's ends (%ld, %ld) are outside the pool", head, tail);
        goto fail;
    }
    long long *ref = B[0].v.buf, *nxt = B[1].v.buf, *prv = B[2].v.buf;
    signed char *is_free = B[3].v.buf;
    released = PyList_New(0);
    still = PyList_New(0);
    cached = PyList_New(0);
    if (released == NULL || still == NULL || cached == NULL) goto fail;
    it = PyObject_GetIter(pages_in);
    if (it == NULL) goto caught;
    while ((item = PyIter_Next(it)) != NULL) {
        Py_ssize_t p = PyNumber_AsSsize_t(item, PyExc_IndexError);
        if (p == -1 && PyErr_Occurred()) goto caught;
        if (p < 0) p += n;                       /* a Python sequence index */
        if (p < 0 || p >= n) {
            PyErr_SetString(PyExc_IndexError, "array index out of range");
            goto caught;
        }
        long long r = ref[p];
        if (r <= 0) {
            PyErr_Format(PyExc_RuntimeError, "page %zd freed with refcount %lld", p, r);
            goto caught;
        }
        ref[p] = r - 1;
        if (r == 1) {                            /* onto the free queue's tail */
            prv[p] = tail;
            nxt[p] = -1;
            if (tail == -1) head = (long)p;
            else nxt[tail] = p;
            tail = (long)p;
            is_free[p] = 1;
            if (PyList_GET_ITEM(page_hash, p) != Py_None && PyList_Append(cached, item) < 0) goto caught;
            if (PyList_Append(released, item) < 0) goto caught;
        } else if (PyList_Append(still, item) < 0) goto caught;
        Py_DECREF(item);
    }
    item = NULL;
    if (PyErr_Occurred()) goto caught;
    goto done;
caught: {
        PyObject *type, *tb;
        PyErr_Fetch(&type, &error, &tb);
        PyErr_NormalizeException(&type, &error, &tb);
        if (tb != NULL && error != NULL) PyException_SetTraceback(error, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
    }
done:
    Py_XDECREF(item);
    Py_XDECREF(it);
    let_go(B, 4);
    if (error == NULL) {
        error = Py_None;
        Py_INCREF(error);
    }
    return Py_BuildValue("(NNNllN)", released, still, cached, head, tail, error);
fail:
    let_go(B, 4);
    Py_XDECREF(released);
    Py_XDECREF(still);
    Py_XDECREF(cached);
    return NULL;
}

/* register_chain(cached, page_hash, page_tokens, page_index, page_parent, pages, chain, index, parent)
 *   -> (entered, indices) */
static PyObject *register_chain(PyObject *self, PyObject *args) {
    PyObject *cached, *L[3], *oindex, *pages, *chain, *parent;
    Py_ssize_t index, n;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!O!O!nO", &PyDict_Type, &cached, &PyList_Type, &L[0], &PyList_Type,
                          &L[1], &oindex, &PyList_Type, &L[2], &PyList_Type, &pages, &PyList_Type, &chain, &index,
                          &parent))
        return NULL;
    PyObject *page_hash = L[0], *tokens = L[1], *page_parent = L[2];
    buf_t B[1];
    memset(B, 0, sizeof B);
    PyObject *entered = NULL, *indices = NULL;
    if (hold(oindex, &B[0], 'q', "page_index") < 0) goto fail;
    if (check_lists(L, 3, &n) < 0) goto fail;
    if (B[0].v.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "pool_ops: the pool's per-page arrays differ in length");
        goto fail;
    }
    long long *page_index = B[0].v.buf;
    entered = PyList_New(0);
    indices = PyList_New(0);
    if (entered == NULL || indices == NULL) goto fail;
    Py_ssize_t k = PyList_GET_SIZE(pages) < PyList_GET_SIZE(chain) ? PyList_GET_SIZE(pages) : PyList_GET_SIZE(chain);
    Py_INCREF(parent);                            /* owned: the hash the next page chains from */
    for (Py_ssize_t i = 0; i < k; i++, index++) {
        PyObject *pobj = PyList_GET_ITEM(pages, i), *link = PyList_GET_ITEM(chain, i);
        if (!PyTuple_Check(link) || PyTuple_GET_SIZE(link) != 2) {
            PyErr_SetString(PyExc_TypeError, "pool_ops: a chain entry is not a (hash, tokens) pair");
            goto fail_parent;
        }
        PyObject *h = PyTuple_GET_ITEM(link, 0), *key = PyTuple_GET_ITEM(link, 1);
        Py_ssize_t p = PyNumber_AsSsize_t(pobj, PyExc_IndexError);
        if (p == -1 && PyErr_Occurred()) goto fail_parent;
        if (p < 0 || p >= n) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto fail_parent;
        }
        if (PyList_GET_ITEM(page_hash, p) == Py_None) {
            /* one probe of the index, not two (contains, then set): the dict grows iff h was new */
            Py_ssize_t size = PyDict_GET_SIZE(cached);
            if (PyDict_SetDefault(cached, h, pobj) == NULL) goto fail_parent;
            if (PyDict_GET_SIZE(cached) != size) {
                PyObject *iobj = PyLong_FromSsize_t(index);
                if (iobj == NULL) goto fail_parent;
                if (PyList_Append(entered, pobj) < 0 || PyList_Append(indices, iobj) < 0) {
                    Py_DECREF(iobj);
                    goto fail_parent;
                }
                Py_DECREF(iobj);
                put(page_hash, p, h);
                put(tokens, p, key);
                put(page_parent, p, parent);
                page_index[p] = index;
            }
        }
        Py_DECREF(parent);
        parent = h;
        Py_INCREF(parent);
    }
    Py_DECREF(parent);
    let_go(B, 1);
    return Py_BuildValue("(NN)", entered, indices);
fail_parent:
    Py_DECREF(parent);
fail:
    let_go(B, 1);
    Py_XDECREF(entered);
    Py_XDECREF(indices);
    return NULL;
}

/* walk(memo, n, cached, page_tokens) -> (pages, hashes): the cached pages of the longest prefix */
static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *memo, *cached, *tokens;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "O!nO!O!", &PyList_Type, &memo, &k, &PyDict_Type, &cached, &PyList_Type, &tokens))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(tokens);
    if (k > PyList_GET_SIZE(memo)) k = PyList_GET_SIZE(memo);
    PyObject *pages = PyList_New(0), *hashes = PyList_New(0);
    if (pages == NULL || hashes == NULL) goto fail;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *link = PyList_GET_ITEM(memo, i);
        if (!PyTuple_Check(link) || PyTuple_GET_SIZE(link) != 2) {
            PyErr_SetString(PyExc_TypeError, "pool_ops: a chain entry is not a (hash, tokens) pair");
            goto fail;
        }
        PyObject *h = PyTuple_GET_ITEM(link, 0), *key = PyTuple_GET_ITEM(link, 1);
        PyObject *pobj = PyDict_GetItemWithError(cached, h);
        if (pobj == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        Py_ssize_t p = PyLong_AsSsize_t(pobj);
        if (p == -1 && PyErr_Occurred()) goto fail;
        if (p < 0 || p >= n) {
            PyErr_Format(PyExc_IndexError, "list index out of range (page %zd of %zd)", p, n);
            goto fail;
        }
        int same = PyObject_RichCompareBool(PyList_GET_ITEM(tokens, p), key, Py_EQ);
        if (same < 0) goto fail;
        if (!same) break;
        if (PyList_Append(pages, pobj) < 0 || PyList_Append(hashes, h) < 0) goto fail;
    }
    return Py_BuildValue("(NN)", pages, hashes);
fail:
    Py_XDECREF(pages);
    Py_XDECREF(hashes);
    return NULL;
}

/* hash((a, b)) exactly as CPython's tuplehash computes it (xxHash-style lanes, unchanged since
 * 3.8), without building the pair: the test suite checks it against hash() on every run. */
#if SIZEOF_VOID_P > 4
#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) ((x << 31) | (x >> 33))
#else
#define XXPRIME_1 ((Py_uhash_t)2654435761UL)
#define XXPRIME_2 ((Py_uhash_t)2246822519UL)
#define XXPRIME_5 ((Py_uhash_t)374761393UL)
#define XXROTATE(x) ((x << 13) | (x >> 19))
#endif

static Py_hash_t pair_hash(PyObject *a, PyObject *b) {
    Py_uhash_t acc = XXPRIME_5;
    PyObject *items[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        Py_uhash_t lane = PyObject_Hash(items[i]);
        if (lane == (Py_uhash_t)-1) return -1;
        acc += lane * XXPRIME_2;
        acc = XXROTATE(acc);
        acc *= XXPRIME_1;
    }
    acc += 2 ^ (XXPRIME_5 ^ 3527539UL);
    if (acc == (Py_uhash_t)-1) return 1546275796;
    return (Py_hash_t)acc;
}

/* hash_chain(root, parent, blocks) -> [(h, block), ...]: h = hash((parent or root, block)), chained */
static PyObject *hash_chain(PyObject *self, PyObject *args) {
    PyObject *root, *parent, *blocks;
    if (!PyArg_ParseTuple(args, "OOO!", &root, &parent, &PyList_Type, &blocks)) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(blocks);
    PyObject *out = PyList_New(k);
    if (out == NULL) return NULL;
    PyObject *h = parent == Py_None ? root : parent;
    Py_INCREF(h);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *block = PyList_GET_ITEM(blocks, i);
        Py_hash_t v = pair_hash(h, block);
        if (v == -1 && PyErr_Occurred()) goto fail;
        Py_DECREF(h);
        h = PyLong_FromSsize_t(v);
        if (h == NULL) { Py_DECREF(out); return NULL; }
        PyObject *link = PyTuple_Pack(2, h, block);
        if (link == NULL) goto fail;
        PyList_SET_ITEM(out, i, link);
    }
    Py_DECREF(h);
    return out;
fail:
    Py_XDECREF(h);
    Py_DECREF(out);
    return NULL;
}

/* count_free(is_free, pages) -> how many of pages are on the free queue (is_free[p] set) */
static PyObject *count_free(PyObject *self, PyObject *args) {
    PyObject *ofree, *pages;
    if (!PyArg_ParseTuple(args, "OO!", &ofree, &PyList_Type, &pages)) return NULL;
    buf_t B[1];
    memset(B, 0, sizeof B);
    if (hold(ofree, &B[0], 'b', "is_free") < 0) { let_go(B, 1); return NULL; }
    signed char *is_free = B[0].v.buf;
    Py_ssize_t n = B[0].v.len, count = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pages); i++) {
        Py_ssize_t p = PyNumber_AsSsize_t(PyList_GET_ITEM(pages, i), PyExc_IndexError);
        if (p == -1 && PyErr_Occurred()) { let_go(B, 1); return NULL; }
        if (p < 0 || p >= n) {
            let_go(B, 1);
            PyErr_SetString(PyExc_IndexError, "array index out of range");
            return NULL;
        }
        count += is_free[p] != 0;
    }
    let_go(B, 1);
    return PyLong_FromSsize_t(count);
}

static PyMethodDef methods[] = {
    {"count_free", count_free, METH_VARARGS, "How many pages are free (see pool_ops.count_free)."},
    {"hash_chain", hash_chain, METH_VARARGS, "Chained page hashes (see pool_ops.hash_chain)."},
    {"take", take, METH_VARARGS, "Pop n pages off the free queue's head (see pool_ops.take)."},
    {"release", release, METH_VARARGS, "Drop one reference per page (see pool_ops.release)."},
    {"register_chain", register_chain, METH_VARARGS, "Enter consecutive pages in the prefix cache."},
    {"walk", walk, METH_VARARGS, "The cached pages of a sequence's longest prefix."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagedkv_pool_ops", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_pagedkv_pool_ops(void) {
    return PyModule_Create(&module);
}
