/* The replay item's per-rollout hot loops in one pass each (docs/DESIGN.md, "The item").
 *
 * replay/validation.py check_values does one numpy reduction per rule (about ten calls of ~2 us
 * each on a 2k-token rollout) and replay/item.py pack one copy per column; every rollout goes
 * through both on the actor and the checks again on the learner. Here:
 *
 *   check(tokens, rollout_logp, versions, rewards, action_mask, vocab_size) -> int
 *       the 1-based index of the first broken rule in VALUE_RULES of replay/validation.py
 *       (0: none), in the order of check_values; one pass over the five columns.
 *   pack(out, tokens, rollout_logp, versions, rewards, action_mask) -> int
 *       copies the five columns into `out` from byte 64 on (the item's layout), returns the
 *       end offset.
 *
 * The columns are buffers of exact dtypes (int32, float32, int32, float32, int8) and equal
 * lengths, C-contiguous; a wrong size raises ValueError. Pure CPython API, no numpy headers.
 * replay/item.py loads it (`native`); without it, and for strided columns, the numpy code runs;
 * tests/test_replay_fastpath.py checks both give the same answers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEADER_BYTES 64
#define NCOLS 5

/* Element sizes of tokens, rollout_logp, versions, rewards, action_mask. */
static const Py_ssize_t ITEMSIZE[NCOLS] = {4, 4, 4, 4, 1};

/* Gets the five column buffers of args[first..first+4]; their common length in *n. */
static int get_columns(PyObject *const *args, Py_buffer *bufs, Py_ssize_t *n) {
    int got = 0;
    for (; got < NCOLS; got++) {
        if (PyObject_GetBuffer(args[got], &bufs[got], PyBUF_C_CONTIGUOUS) < 0) goto fail;
        if (bufs[got].len % ITEMSIZE[got] != 0) {
            PyErr_SetString(PyExc_ValueError, "a column's byte size is not a multiple of its "
                                              "dtype's size");
            got++;
            goto fail;
        }
    }
    *n = bufs[4].len;  /* action_mask: one byte per token */
    for (int i = 0; i < NCOLS; i++) {
        if (bufs[i].len != *n * ITEMSIZE[i]) {
            PyErr_SetString(PyExc_ValueError, "the columns have different lengths");
            goto fail;
        }
    }
    return 0;
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    return -1;
}

static void release(Py_buffer *bufs) {
    for (int i = 0; i < NCOLS; i++) PyBuffer_Release(&bufs[i]);
}

/* A float32 is NaN or +-inf when its exponent bits are all ones. */
static inline uint32_t nonfinite(uint32_t bits) {
    return (bits & 0x7f800000u) == 0x7f800000u;
}

static PyObject *check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "check(tokens, rollout_logp, versions, rewards, "
                                         "action_mask, vocab_size)");
        return NULL;
    }
    unsigned long long vocab = PyLong_AsUnsignedLongLong(args[5]);
    if (vocab == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_buffer bufs[NCOLS];
    Py_ssize_t n;
    if (get_columns(args, bufs, &n) < 0) return NULL;
    const uint32_t *tokens = (const uint32_t *)bufs[0].buf;  /* a negative id reads >= 2**31 */
    const uint32_t *logp = (const uint32_t *)bufs[1].buf;
    const int32_t *versions = (const int32_t *)bufs[2].buf;
    const uint32_t *rewards = (const uint32_t *)bufs[3].buf;
    const uint8_t *mask = (const uint8_t *)bufs[4].buf;   /* int8 -1 reads as 255 */
    uint32_t bad_mask = 0, actions = 0, out_of_range = 0, bad_logp = 0, bad_version = 0,
             bad_reward = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t m = mask[i];
        uint32_t act = (m == 1);
        bad_mask |= (m > 1);
        actions |= act;
        out_of_range |= ((unsigned long long)tokens[i] >= vocab);
        bad_logp |= act & nonfinite(logp[i]);
        bad_version |= act & (uint32_t)(versions[i] < 0);
        bad_reward |= nonfinite(rewards[i]);
    }
    int reason = bad_mask ? 1 : !actions ? 2 : (n > 0 && mask[0]) ? 3 : out_of_range ? 4
               : bad_logp ? 5 : bad_version ? 6 : bad_reward ? 7 : 0;
    release(bufs);
    return PyLong_FromLong(reason);
}

static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "pack(out, tokens, rollout_logp, versions, rewards, "
                                         "action_mask)");
        return NULL;
    }
    Py_buffer out;
    if (PyObject_GetBuffer(args[0], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_buffer bufs[NCOLS];
    Py_ssize_t n;
    if (get_columns(args + 1, bufs, &n) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t need = HEADER_BYTES;
    for (int i = 0; i < NCOLS; i++) need += bufs[i].len;
    if (out.len < need) {
        release(bufs);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "the output buffer is too small for the item");
        return NULL;
    }
    char *dst = (char *)out.buf + HEADER_BYTES;
    for (int i = 0; i < NCOLS; i++) {
        memcpy(dst, bufs[i].buf, (size_t)bufs[i].len);
        dst += bufs[i].len;
    }
    release(bufs);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(need);
}

static PyMethodDef methods[] = {
    {"check", (PyCFunction)(void (*)(void))check, METH_FASTCALL,
     "The index of the first broken rule (0: none); see the module doc."},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL,
     "Copies the five columns into out from byte 64; returns the end offset."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_itemfast",
    "One-pass checks and packing of replay items (see _itemfast.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__itemfast(void) { return PyModule_Create(&module); }
