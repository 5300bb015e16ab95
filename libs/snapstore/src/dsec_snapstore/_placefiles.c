/*
 * dsec_snapstore._placefiles: a restore's new files written in C, without the GIL.
 *
 * A full restore writes thousands of small files from two threads: each thread reads a span of
 * a pack (decompress, hash) and then writes the files whose bytes it brought. In Python each
 * file is an os.open, an os.write and an os.close, and each of those gives the GIL away and
 * waits to get it back from the other thread, which holds it while it decompresses and hashes
 * (the convoy: two threads restored no faster than one). write_files() writes a whole list of
 * files in one call that holds the GIL only to read its arguments.
 *
 *     write_files([(path, data, mode, exact), ...]) -> bytes written
 *
 * Each path is created with O_CREAT | O_EXCL | O_NOFOLLOW (never through an existing file or
 * link: a fresh restore writes only below its own new directory), with `mode` when `exact`
 * (the umask leaves it intact), else private and given `mode` with fchmod after the write, as
 * dsec_snapstore.adapters.tree.place does. The first failure stops the call and raises the
 * OSError that os.open/os.write would have, with the path; the files before it stay written
 * (the restore removes its whole staging directory on any error).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    PyObject *path;   /* bytes (file system encoding) */
    Py_buffer data;
    int mode;
    int exact;
    int has_data;     /* data holds a buffer to release */
} item_t;

static PyObject *write_files(PyObject *module, PyObject *arg) {
    (void)module;
    /* An immutable copy: nothing run while the arguments are read (a path's __fspath__, a
     * mode's __index__), nor another thread while the GIL is released, can change the items. */
    PyObject *seq = PySequence_Tuple(arg);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    item_t *items = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(item_t));
    if (items == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(seq, i);
        item_t *it = &items[i];
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4) {
            PyErr_SetString(PyExc_TypeError, "write_files: each item is (path, data, mode, exact)");
            goto done;
        }
        if (!PyUnicode_FSConverter(PyTuple_GET_ITEM(t, 0), &it->path)) {
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(t, 1), &it->data, PyBUF_SIMPLE) < 0) {
            goto done;
        }
        it->has_data = 1;
        long mode = PyLong_AsLong(PyTuple_GET_ITEM(t, 2));
        if (mode == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (mode < 0 || mode > 07777) {
            PyErr_Format(PyExc_ValueError, "write_files: mode %ld is not a file mode", mode);
            goto done;
        }
        it->mode = (int)mode;
        int exact = PyObject_IsTrue(PyTuple_GET_ITEM(t, 3));
        if (exact < 0) {
            goto done;
        }
        it->exact = exact;
    }

    Py_ssize_t failed = -1;
    int err = 0;
    long long total = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        item_t *it = &items[i];
        int fd = open(PyBytes_AS_STRING(it->path), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                      it->exact ? it->mode : 0600);
        if (fd < 0) {
            err = errno;
            failed = i;
            break;
        }
        const char *buf = it->data.buf;
        Py_ssize_t left = it->data.len;
        while (left > 0) {
            ssize_t w = write(fd, buf, (size_t)left);
            if (w < 0) {
                if (errno == EINTR) {
                    continue;
                }
                err = errno;
                break;
            }
            buf += w;
            left -= w;
        }
        if (err == 0 && !it->exact && fchmod(fd, (mode_t)it->mode) < 0) {
            err = errno;
        }
        if (close(fd) < 0 && err == 0 && errno != EINTR) {
            err = errno;
        }
        if (err != 0) {
            failed = i;
            break;
        }
        total += it->data.len;
    }
    Py_END_ALLOW_THREADS

    if (failed >= 0) {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(
            PyExc_OSError, PyTuple_GET_ITEM(PyTuple_GET_ITEM(seq, failed), 0));
        goto done;
    }
    result = PyLong_FromLongLong(total);

done:
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(items[i].path);
        if (items[i].has_data) {
            PyBuffer_Release(&items[i].data);
        }
    }
    PyMem_Free(items);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"write_files", write_files, METH_O,
     "write_files(items) -> int\n\nCreate and write each (path, data, mode, exact) of items "
     "(O_EXCL, O_NOFOLLOW) without the GIL; the bytes written. The first failure raises its "
     "OSError."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dsec_snapstore._placefiles",
    "A restore's new files written in C, without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__placefiles(void) { return PyModule_Create(&module); }
