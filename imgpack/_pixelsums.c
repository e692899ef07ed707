/* Per-channel sums of an image's uint8 values and of their squares, exact, in one pass.
 *
 * sums(buffer, depth) -> (sums, squares): two tuples of `depth` Python ints, for a C-contiguous
 * buffer of interleaved values (H x W x depth, or H x W gray with depth 1). The values are
 * taken in runs of LANES bytes (a multiple of 1, 2, 3 and 4: every run starts on channel 0),
 * each lane summed in 32 bits (its squares too) and folded into 64-bit totals before a lane
 * could overflow; the compiler vectorizes the run's loop. The bytes past the last whole run
 * are added one by one. The pass runs without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define LANES 48
/* Runs summed in 32 bits before the lanes are folded: 255 * 255 * FOLD < 2**32. */
#define FOLD 65536

static void sum_values(const uint8_t *data, Py_ssize_t size, int depth, uint64_t *sums,
                       uint64_t *squares) {
    uint64_t lane_sums[LANES] = {0}, lane_squares[LANES] = {0};
    uint32_t run_sums[LANES], run_squares[LANES];
    Py_ssize_t runs = size / LANES, done = 0;
    while (done < runs) {
        Py_ssize_t stop = runs - done < FOLD ? runs : done + FOLD;
        memset(run_sums, 0, sizeof run_sums);
        memset(run_squares, 0, sizeof run_squares);
        for (; done < stop; done++) {
            const uint8_t *run = data + done * LANES;
            for (int j = 0; j < LANES; j++) {
                uint32_t v = run[j];
                run_sums[j] += v;
                run_squares[j] += v * v;
            }
        }
        for (int j = 0; j < LANES; j++) {
            lane_sums[j] += run_sums[j];
            lane_squares[j] += run_squares[j];
        }
    }
    for (int j = 0; j < LANES; j++) {
        sums[j % depth] += lane_sums[j];
        squares[j % depth] += lane_squares[j];
    }
    for (Py_ssize_t k = runs * LANES; k < size; k++) {
        uint64_t v = data[k];
        sums[k % depth] += v;
        squares[k % depth] += v * v;
    }
}

static PyObject *sums(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    int depth;
    if (!PyArg_ParseTuple(args, "y*i", &view, &depth)) {
        return NULL;
    }
    if (depth < 1 || depth > 4 || LANES % depth != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "depth must be 1, 2, 3 or 4");
        return NULL;
    }
    uint64_t totals[4] = {0}, squares[4] = {0};
    Py_BEGIN_ALLOW_THREADS
    sum_values((const uint8_t *)view.buf, view.len, depth, totals, squares);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *found = PyTuple_New(depth), *squared = PyTuple_New(depth);
    if (found == NULL || squared == NULL) {
        Py_XDECREF(found);
        Py_XDECREF(squared);
        return NULL;
    }
    for (int c = 0; c < depth; c++) {
        PyObject *total = PyLong_FromUnsignedLongLong(totals[c]);
        PyObject *square = PyLong_FromUnsignedLongLong(squares[c]);
        if (total == NULL || square == NULL) {
            Py_XDECREF(total);
            Py_XDECREF(square);
            Py_DECREF(found);
            Py_DECREF(squared);
            return NULL;
        }
        PyTuple_SET_ITEM(found, c, total);
        PyTuple_SET_ITEM(squared, c, square);
    }
    return Py_BuildValue("(NN)", found, squared);
}

static PyMethodDef methods[] = {
    {"sums", sums, METH_VARARGS,
     "sums(buffer, depth) -> (sums, squares): per-channel sums of a C-contiguous buffer of "
     "interleaved uint8 values (depth channels) and of their squares, exact."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pixelsums",
    "Per-channel sums of uint8 values and of their squares, exact, in one pass.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pixelsums(void) { return PyModule_Create(&module); }
