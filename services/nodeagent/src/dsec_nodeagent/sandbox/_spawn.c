/* The workload's execve in a sibling that shares the caller's memory (dsec_nodeagent.sandbox.init).
 *
 * spawn(path, argv, env, uid, gid) -> pid
 *
 * clone(CLONE_VM | CLONE_VFORK | CLONE_PARENT): the child runs on a small stack of its own in the
 * caller's memory (nothing is copied, as with vfork) while the caller waits; it makes its own
 * session, drops to `uid`/`gid` with no supplementary groups and execs. The caller keeps its own
 * uid: the workload cannot signal a process of another uid, so it cannot stop or kill the
 * caller, which then tells the sandbox's init the workload's pid. The caller's memory is not
 * torn down by that execve (a forked interpreter's tens of MB: 1-2 ms before the workload's
 * first instruction); the caller frees it as it exits, beside the workload. CLONE_PARENT: the workload is the caller's parent's child (the sandbox's
 * init) from its first instruction, never the caller's, so the caller's exit changes nothing the
 * workload can see (its parent, a parent-death signal it sets at once).
 *
 * As glibc's posix_spawn: every signal is blocked around the clone; the child puts each handled
 * signal back to its default action (a handler must not run in it: it shares the caller's memory),
 * then the caller's signal mask, then execs. A failed execve reaches the caller as the OSError
 * execve itself would raise (the failed child, a zombie of the caller's parent, is reaped there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CHILD_STACK (64 * 1024)

struct child_args {
    const char *path;
    char *const *argv;
    char *const *envp;
    long uid, gid;
    sigset_t mask;
    volatile int err;
};

static int child_main(void *opaque) {
    struct child_args *args = opaque;
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction old;
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        if (sigaction(sig, NULL, &old) == 0 && old.sa_handler != SIG_IGN &&
            old.sa_handler != SIG_DFL)
            sigaction(sig, &dfl, NULL);
    }
    /* Raw system calls for the credentials: glibc's wrappers would signal the threads of the
     * process whose memory this is (its set*id broadcast), and only this task's change. */
    if (setsid() < 0 || syscall(SYS_setgroups, 0, NULL) < 0 ||
        syscall(SYS_setresgid, args->gid, args->gid, args->gid) < 0 ||
        syscall(SYS_setresuid, args->uid, args->uid, args->uid) < 0) {
        args->err = errno;
        _exit(127);
    }
    sigprocmask(SIG_SETMASK, &args->mask, NULL);
    execve(args->path, args->argv, args->envp);
    args->err = errno;
    _exit(127);
}

/* The C string of a bytes object (borrowed: `item` keeps it alive); NULL with an error set when
 * `item` is no bytes or holds a null byte. */
static char *c_string(PyObject *item, const char *what) {
    char *data;
    Py_ssize_t size;
    if (!PyBytes_Check(item) || PyBytes_AsStringAndSize(item, &data, &size) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: bytes expected", what);
        return NULL;
    }
    if ((size_t)size != strlen(data)) {
        PyErr_Format(PyExc_ValueError, "%s: embedded null byte", what);
        return NULL;
    }
    return data;
}

/* A NULL-terminated array of the bytes objects of `seq` (borrowed: `seq` keeps them alive). */
static char **c_strings(PyObject *seq, const char *what) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((out[i] = c_string(PySequence_Fast_GET_ITEM(seq, i), what)) == NULL) {
            PyMem_Free(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *spawn(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "spawn(path, argv, env, uid, gid) takes 5 arguments");
        return NULL;
    }
    long uid = PyLong_AsLong(args[3]), gid = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    /* Never root's, and never -1 (which setresuid reads as "unchanged"). */
    if (uid < 1 || gid < 1 || uid >= 0xFFFFFFFFL || gid >= 0xFFFFFFFFL) {
        PyErr_SetString(PyExc_ValueError, "uid and gid: a sandbox's, 1 to 4294967294");
        return NULL;
    }
    PyObject *path = args[0];
    const char *c_path = c_string(path, "path");
    if (c_path == NULL) return NULL;
    PyObject *argv = PySequence_Fast(args[1], "argv: a sequence expected");
    if (argv == NULL) return NULL;
    PyObject *env = PySequence_Fast(args[2], "env: a sequence expected");
    if (env == NULL) {
        Py_DECREF(argv);
        return NULL;
    }
    PyObject *result = NULL;
    char **c_argv = NULL, **c_env = NULL;
    void *stack = MAP_FAILED;
    if (PySequence_Fast_GET_SIZE(argv) == 0) {
        PyErr_SetString(PyExc_ValueError, "argv: empty");
        goto done;
    }
    if ((c_argv = c_strings(argv, "argv")) == NULL || (c_env = c_strings(env, "env")) == NULL)
        goto done;
    stack = mmap(NULL, CHILD_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK,
                 -1, 0);
    if (stack == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    struct child_args child = {.path = c_path,
                               .argv = c_argv,
                               .envp = c_env,
                               .uid = uid,
                               .gid = gid,
                               .err = 0};
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &child.mask);
    int pid = clone(child_main, (char *)stack + CHILD_STACK,
                    CLONE_VM | CLONE_VFORK | CLONE_PARENT | SIGCHLD, &child);
    int clone_errno = errno;
    pthread_sigmask(SIG_SETMASK, &child.mask, NULL);
    if (pid < 0) {
        errno = clone_errno;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if (child.err != 0) {
        errno = child.err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    } else {
        result = PyLong_FromLong(pid);
    }
done:
    if (stack != MAP_FAILED) munmap(stack, CHILD_STACK);
    PyMem_Free(c_argv);
    PyMem_Free(c_env);
    Py_DECREF(argv);
    Py_DECREF(env);
    return result;
}

static PyMethodDef methods[] = {
    {"spawn", (PyCFunction)(void (*)(void))spawn, METH_FASTCALL,
     "spawn(path, argv, env, uid, gid) -> pid: execve in a sibling sharing this memory, in a "
     "session of its own, as uid/gid (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_spawn", "The workload's execve in a sibling sharing this memory.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__spawn(void) { return PyModule_Create(&module); }
