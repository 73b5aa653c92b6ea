"""A file mapped into memory, handing out zero-copy views of its bytes.

``MappedFile(path)`` maps the whole file read-only (``copy_on_write=True``:
private and writable, the file itself never changes) and advises the kernel
that it will be read sequentially and soon. ``view(offset, length)`` returns a
``memoryview`` and ``array(offset, dtype, shape)`` a numpy array over the
mapped bytes; neither copies, and each keeps the mapping alive by itself.

Lifetime rules (the same discipline as h5py's handles):

- ``close()`` is idempotent. Views made before it stay valid: the mapping is
  unmapped only when the last view is gone (each view holds a reference to the
  block that owns the mapping, and the block unmaps in ``__dealloc__``, which
  needs no Python and so is safe at interpreter shutdown).
- The mapping pins the file's inode. A file *replaced* on disk (written to a
  temporary and renamed, as every fastckpt writer does) leaves existing views
  untouched. A file truncated in place makes the kernel send SIGBUS on access
  past its new end; fastckpt never truncates, and every copy it makes out of a
  mapping runs under ``guard()``, which turns that into a ``FormatError``
  ("truncated or replaced while reading") and poisons the handle: every later
  ``view``, ``array``, ``read`` and guard raises the same error. Views handed
  out are plain mapped memory: one made before the fault reads zeros from the
  first missing page on; read outside any guard after such a truncation (in a
  thread that holds no guard), one kills the process as any mapping would
  (``backend="pread"`` hands out copies instead). Every SIGBUS that is not the
  guard's goes to the handler installed before it (see ``guard()``).

``backend="pread"`` serves filesystems that cannot map (some network and FUSE
filesystems): the same API, but each ``view()`` reads its bytes into a fresh
page-aligned buffer, so views are copies. ``view()``, ``array()`` and
``read()`` may run in several threads at once, also while another thread
closes the file: the descriptor is closed only when the last read in flight
has finished (closing it earlier would let a new ``open`` reuse its number,
and the read would return another file's bytes).

``MappedFile.from_buffer(data)`` serves bytes held in memory (``fastckpt``'s
``load_bytes``): the same API over a private, page-aligned copy of them.

``identity`` is what ``fstat`` said of the file when it was opened; a cache
compares it with ``os.stat(path)`` to learn whether the path still names the
same, unchanged file (see ``fastckpt.device.pool.OpenFiles``).

Every read goes through ``span()``, which checks ``0 <= offset`` and
``offset + length <= size`` with overflow-safe arithmetic and raises
:class:`fastckpt.errors.FormatError` naming the file, what was being read,
the byte range and the file size.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF

cimport numpy as cnp
from libc.errno cimport EFAULT, EINTR, errno
from libc.stdint cimport uint8_t, uintptr_t
from libc.stdlib cimport free
from libc.string cimport memcpy, strerror

import os

import numpy as np

from fastckpt.errors import FormatError

cnp.import_array()

cdef extern from *:
    Py_ssize_t PY_SSIZE_T_MAX

DEF _MAX_DIMS = 32  # numpy 1.x's NPY_MAXDIMS; numpy 2 allows 64, no tensor file needs more


cdef extern from "<sys/mman.h>" nogil:
    void* mmap(void* addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void* addr, size_t length)
    int madvise(void* addr, size_t length, int advice)
    void* MAP_FAILED
    int PROT_READ
    int PROT_WRITE
    int MAP_SHARED
    int MAP_PRIVATE
    int MAP_POPULATE
    int MADV_NORMAL
    int MADV_SEQUENTIAL
    int MADV_RANDOM
    int MADV_WILLNEED
    int MADV_DONTNEED

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** memptr, size_t alignment, size_t size)

cdef extern from "<unistd.h>" nogil:
    ssize_t pread(int fd, void* buf, size_t count, long offset)
    int close(int fd)
    long sysconf(int name)
    int _SC_PAGESIZE

cdef extern from "<fcntl.h>" nogil:
    int O_RDONLY
    int O_CLOEXEC



# The truncation guard (see MappedFile.guard): a SIGBUS handler that, for a fault inside a mapping read under a
# guard, maps zero pages from the faulting page to the mapping's end, records the first faulting address and
# returns, so the copy runs to its end and the guard's exit raises. Patching rather than jumping out
# (sigsetjmp/siglongjmp) is what reaches copies made by threads that fastckpt does not own.
#
# Whose fault is it: a guard is a *hold* of the thread that entered it on the mapping's *cell* (one per guarded
# mapping, shared by every thread guarding it, where the fault is recorded). A fault is patched when the
# faulting thread holds a guard over the address, or when the thread is not a Python thread (no Python thread
# state: BLAKE3's and the OpenCL runtime's workers, which copy on behalf of a guarded call) and some thread
# holds one. A Python thread without a guard of its own (a plain view read while another thread loads from the
# same file) is not covered: its fault goes where it would without fastckpt. fastckpt's own worker threads
# enter the guards of the call they work for (held_guards()).
#
# Cells and holds are records of one table that grows in chunks never freed (the handler may be walking them), so
# no number of guarded mappings is too many; claiming and releasing is a free-list pop and push under the GIL.
#
# Chaining: every fault or sent SIGBUS that is not ours goes to the handler installed before ours, every time,
# by calling it (with its mask and flags) rather than reinstalling it, so that ours stays in place. Guard
# entries check that ours is still installed (faulthandler.enable(), signal.signal and C code may replace it)
# and put it back, remembering the replacement as the newest previous handler. A replacement that passes a
# signal on to *its* previous handler (ours, from an earlier install; faulthandler does, by raise()) re-enters
# ours while it is being called: a per-thread depth says how far down the list of previous handlers to go, so
# the signal travels the same chain it would have without the re-install, ending in the default action.
cdef extern from *:
    """
    #include <errno.h>
    #include <pthread.h>
    #include <signal.h>
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    #include <sys/mman.h>
    #include <time.h>
    #include <unistd.h>

    #define FC_CHUNK 256

    /* One record type for both: a *cell* (one per guarded mapping: its range, and the first fault met in it)
       and a *hold* (one per guard entered: the thread, and the cell it guards). A record is a hold while `cell`
       is set; cells never set it. */
    typedef struct fc_rec {
        uintptr_t start, end;           /* cell: the mapping */
        uintptr_t fault;                /* cell: the first faulting address met under a guard, 0: none (atomic) */
        int prot;                       /* cell: the mapping's protection, for the zero pages */
        struct fc_rec *cell;            /* hold: the guarded mapping's cell, NULL while free (atomic) */
        uintptr_t thread;               /* hold: pthread_self() of the thread that entered the guard */
        PyObject *block, *path, *what;  /* hold: borrowed from the guard while held, for held_guards() (GIL) */
        struct fc_rec *next_free;       /* free list (GIL) */
    } fc_rec;
    typedef fc_rec fc_cell;
    typedef fc_rec fc_hold;

    typedef struct fc_chunk { fc_rec item[FC_CHUNK]; struct fc_chunk *next; } fc_chunk;

    /* A handler that was installed before ours, the newest first. */
    typedef struct fc_prev { struct sigaction act; struct fc_prev *older; int reset; } fc_prev;

    static fc_chunk *fc_chunks;                 /* walked by the handler (atomic head, chunks never freed) */
    static fc_rec *fc_free;
    static fc_prev *fc_prev_head;               /* atomic */
    static uintptr_t fc_page = 4096;
    static __thread int fc_depth __attribute__((tls_model("initial-exec")));  /* previous handlers being run */
    /* A test's pause point in the handler, right after a patch (_pause_after_patch): 0 off, 1 armed, 2 a handler
       waits there (atomic). */
    static int fc_pause;

    /* The default action of `sig`: for a fault, return and let the access run again (the kernel then ends the
       process, with a core dump where those are on, as it would have the first time); a sent signal is sent
       again. */
    static void fc_default(int sig, siginfo_t *info) {
        struct sigaction dfl;
        sigset_t unblock;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(sig, &dfl, NULL);
        if (info->si_code <= 0) {
            sigemptyset(&unblock);
            sigaddset(&unblock, sig);
            pthread_sigmask(SIG_UNBLOCK, &unblock, NULL);
            raise(sig);
        }
    }

    /* Give the signal to the handler installed before ours (`fc_depth` handlers down the list). */
    static void fc_chain(int sig, siginfo_t *info, void *context) {
        fc_prev *p = __atomic_load_n(&fc_prev_head, __ATOMIC_ACQUIRE);
        int d;
        for (d = fc_depth; p != NULL && d > 0; d--)
            p = p->older;
        if (p != NULL && !__atomic_load_n(&p->reset, __ATOMIC_ACQUIRE)) {
            int siginfo = (p->act.sa_flags & SA_SIGINFO) != 0;
            void (*plain)(int) = p->act.sa_handler;
            if (siginfo || (plain != SIG_DFL && plain != SIG_IGN)) {
                sigset_t mask = p->act.sa_mask, old;
                if (!(p->act.sa_flags & SA_NODEFER))
                    sigaddset(&mask, sig);
                if (p->act.sa_flags & SA_RESETHAND)
                    __atomic_store_n(&p->reset, 1, __ATOMIC_RELEASE);
                pthread_sigmask(SIG_BLOCK, &mask, &old);
                fc_depth++;
                if (siginfo)
                    p->act.sa_sigaction(sig, info, context);
                else
                    plain(sig);
                pthread_sigmask(SIG_SETMASK, &old, NULL);  /* a signal it raised while masked arrives here */
                fc_depth--;
                return;
            }
            if (plain == SIG_IGN && info->si_code <= 0)
                return;  /* a sent SIGBUS the program ignores (an ignored fault ends the process all the same) */
        }
        fc_default(sig, info);
    }

    /* The pause point of _pause_after_patch: hold the faulting thread where the scheduler may preempt it (its
       return from mmap(2) in fc_patch) until the test lets it go, at most 30 s, so that a test sees what other
       threads' guards can see in that window. Signal-safe. */
    static void fc_wait_after_patch(void) {
        struct timespec tick = {0, 1000000};
        int i;
        __atomic_store_n(&fc_pause, 2, __ATOMIC_RELEASE);
        for (i = 0; i < 30000 && __atomic_load_n(&fc_pause, __ATOMIC_ACQUIRE) == 2; i++)
            nanosleep(&tick, NULL);
    }

    static int fc_pause_set(int state) {
        return state < 0 ? __atomic_load_n(&fc_pause, __ATOMIC_ACQUIRE)
                         : __atomic_exchange_n(&fc_pause, state, __ATOMIC_ACQ_REL);
    }

    /* Record the fault in the cell, then map zero pages from the faulting page to the end of the cell's
       mapping; 0 if the mapping fails (the fault stays recorded: the file did lose those bytes).

       The order is the guard's promise. Once the zero pages are in, a copy in another thread that holds a
       guard over the mapping reads them without faulting, and only the cell tells its guard's exit that they
       are not the file's. Recorded after the patch, a thread preempted between the two (the return from the
       mmap system call is where the scheduler switches) let such a copy run, leave its guard with no fault
       recorded, and return the zeros as data. Recorded first (a full barrier before the mmap), every read of
       a zero page comes after the record, and every guard left after that read sees it. */
    static int fc_patch(fc_cell *c, uintptr_t addr) {
        uintptr_t page = addr & ~(fc_page - 1);
        uintptr_t end = (c->end + fc_page - 1) & ~(fc_page - 1);
        uintptr_t none = 0;
        __atomic_compare_exchange_n(&c->fault, &none, addr, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        /* A truncation takes every page from here to the end: patch them all at once rather than take one
           signal per page (the mapping is dead from now on anyway). */
        if (mmap((void *)page, end - page, c->prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
            return 0;
        if (__atomic_load_n(&fc_pause, __ATOMIC_ACQUIRE))
            fc_wait_after_patch();
        return 1;
    }

    static void fc_guard_handler(int sig, siginfo_t *info, void *context) {
        int saved = errno;
        if (info->si_code > 0) {  /* a fault, not a kill() */
            uintptr_t addr = (uintptr_t)info->si_addr, self = (uintptr_t)pthread_self();
            fc_cell *mine = NULL, *other = NULL;
            fc_chunk *chunk;
            int i;
            for (chunk = __atomic_load_n(&fc_chunks, __ATOMIC_ACQUIRE); chunk != NULL && mine == NULL;
                 chunk = chunk->next) {
                for (i = 0; i < FC_CHUNK; i++) {
                    fc_cell *c = __atomic_load_n(&chunk->item[i].cell, __ATOMIC_ACQUIRE);
                    if (c != NULL && addr >= c->start && addr < c->end) {
                        if (__atomic_load_n(&chunk->item[i].thread, __ATOMIC_RELAXED) == self) {
                            mine = c;
                            break;
                        }
                        if (other == NULL)
                            other = c;
                    }
                }
            }
            if (mine == NULL && other != NULL && PyGILState_GetThisThreadState() == NULL)
                mine = other;  /* a runtime's worker thread copying for a guarded call */
            if (mine != NULL && fc_patch(mine, addr)) {
                errno = saved;
                return;  /* the access runs again and reads zeros */
            }
        }
        fc_chain(sig, info, context);
        errno = saved;
    }

    static int fc_same_action(const struct sigaction *a, const struct sigaction *b) {
        if ((a->sa_flags & SA_SIGINFO) != (b->sa_flags & SA_SIGINFO) || a->sa_flags != b->sa_flags)
            return 0;
        return (a->sa_flags & SA_SIGINFO) ? a->sa_sigaction == b->sa_sigaction : a->sa_handler == b->sa_handler;
    }

    /* Install the handler unless it is the current one; what it replaces becomes the newest previous handler.
       One system call when it is in place. Called with the GIL held. */
    static int fc_guard_install(void) {
        struct sigaction current, mine;
        fc_prev *head;
        if (sigaction(SIGBUS, NULL, &current) != 0)
            return -1;
        if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == fc_guard_handler)
            return 0;
        fc_page = (uintptr_t)sysconf(_SC_PAGESIZE);
        head = __atomic_load_n(&fc_prev_head, __ATOMIC_ACQUIRE);
        if (head == NULL || head->reset || !fc_same_action(&head->act, &current)) {
            fc_prev *p = (fc_prev *)calloc(1, sizeof *p);  /* never freed: the handler may be reading it */
            if (p == NULL) {
                errno = ENOMEM;
                return -1;
            }
            p->act = current;
            p->older = head;
            __atomic_store_n(&fc_prev_head, p, __ATOMIC_RELEASE);
        }
        memset(&mine, 0, sizeof mine);
        mine.sa_sigaction = fc_guard_handler;
        mine.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&mine.sa_mask);
        return sigaction(SIGBUS, &mine, NULL);
    }

    /* A free record, NULL when out of memory: the tables grow a chunk at a time. GIL held. */
    static fc_rec *fc_claim(void) {
        fc_rec *r = fc_free;
        if (r == NULL) {
            fc_chunk *chunk = (fc_chunk *)calloc(1, sizeof *chunk);  /* never freed: the handler walks them */
            int i;
            if (chunk == NULL)
                return NULL;
            for (i = 0; i < FC_CHUNK; i++)
                chunk->item[i].next_free = i + 1 < FC_CHUNK ? &chunk->item[i + 1] : NULL;
            chunk->next = fc_chunks;
            __atomic_store_n(&fc_chunks, chunk, __ATOMIC_RELEASE);
            r = &chunk->item[0];
        }
        fc_free = r->next_free;
        return r;
    }

    static void fc_release(fc_rec *r) {
        r->next_free = fc_free;
        fc_free = r;
    }

    /* A cell for the mapping [start, end), NULL when out of memory. GIL held. */
    static fc_cell *fc_cell_claim(uintptr_t start, uintptr_t end, int prot) {
        fc_cell *c = fc_claim();
        if (c == NULL)
            return NULL;
        c->start = start;
        c->end = end;
        c->prot = prot;
        __atomic_store_n(&c->fault, 0, __ATOMIC_RELEASE);
        return c;
    }

    static void fc_cell_release(fc_cell *c) {
        fc_release(c);
    }

    static uintptr_t fc_cell_fault(fc_cell *c) {
        return __atomic_load_n(&c->fault, __ATOMIC_ACQUIRE);
    }

    /* A hold of this thread on `c`, NULL when out of memory. GIL held. */
    static fc_hold *fc_hold_claim(fc_cell *c, PyObject *block, PyObject *path, PyObject *what) {
        fc_hold *h = fc_claim();
        if (h == NULL)
            return NULL;
        h->block = block;
        h->path = path;
        h->what = what;
        __atomic_store_n(&h->thread, (uintptr_t)pthread_self(), __ATOMIC_RELAXED);
        __atomic_store_n(&h->cell, c, __ATOMIC_RELEASE);
        return h;
    }

    static void fc_hold_release(fc_hold *h) {
        __atomic_store_n(&h->cell, NULL, __ATOMIC_RELEASE);
        fc_release(h);
    }

    /* Append (block, path, what) to `out` for each guard this thread holds, oldest mapping first. GIL held. */
    static int fc_held_by_this_thread(PyObject *out) {
        uintptr_t self = (uintptr_t)pthread_self();
        fc_chunk *chunk;
        int i;
        for (chunk = fc_chunks; chunk != NULL; chunk = chunk->next) {
            for (i = 0; i < FC_CHUNK; i++) {
                fc_hold *h = &chunk->item[i];
                if (h->cell != NULL && h->thread == self) {
                    PyObject *t = PyTuple_Pack(3, h->block, h->path, h->what);
                    if (t == NULL || PyList_Append(out, t) != 0) {
                        Py_XDECREF(t);
                        return -1;
                    }
                    Py_DECREF(t);
                }
            }
        }
        return 0;
    }
    """
    ctypedef struct fc_cell:
        pass
    ctypedef struct fc_hold:
        pass
    int fc_guard_install() nogil
    fc_cell* fc_cell_claim(uintptr_t start, uintptr_t end, int prot) nogil
    void fc_cell_release(fc_cell* c) nogil
    uintptr_t fc_cell_fault(fc_cell* c) nogil
    fc_hold* fc_hold_claim(fc_cell* c, PyObject* block, PyObject* path, PyObject* what)
    void fc_hold_release(fc_hold* h) nogil
    int fc_held_by_this_thread(object out) except -1
    int fc_pause_set(int state)

cdef uint8_t _EMPTY[1]

_ADVICE = {
    "normal": MADV_NORMAL,
    "sequential": MADV_SEQUENTIAL,
    "random": MADV_RANDOM,
    "willneed": MADV_WILLNEED,
    "dontneed": MADV_DONTNEED,
}

PAGE_SIZE = int(sysconf(_SC_PAGESIZE))


cdef class _Block:
    """Owns one region of memory (a mapping or an aligned allocation) and exports it as a buffer."""

    def __cinit__(self):
        self.ptr = NULL
        self.size = 0
        self.is_mmap = False
        self.writable = False
        self.cell = NULL
        self.guards = 0
        self.fault_offset = -1
        self.fault_message = None

    def __dealloc__(self):
        # No Python here: this may run at interpreter shutdown.
        if self.cell != NULL:  # a guard still open (its object leaked in a cycle): free the cell first
            fc_cell_release(<fc_cell*>self.cell)
            self.cell = NULL
        if self.ptr != NULL:
            if self.is_mmap:
                munmap(self.ptr, <size_t>self.size)
            else:
                free(self.ptr)
            self.ptr = NULL

    def __getbuffer__(self, Py_buffer* buf, int flags):
        if (flags & PyBUF_WRITABLE) and not self.writable:
            raise BufferError("the mapping is read-only; open the file with copy_on_write=True for a writable private view")
        buf.buf = <void*>(self.ptr if self.ptr != NULL else _EMPTY)
        buf.obj = self
        buf.len = self.size
        buf.readonly = 0 if self.writable else 1
        buf.itemsize = 1
        buf.format = "B"
        buf.ndim = 1
        buf.shape = &self.size
        buf.strides = NULL
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer* buf):
        pass


cdef int _note_fault(_Block b, uintptr_t fault, object path, object what) except -1:
    """Remember the first truncation met in ``b`` (its offset and the FormatError every later read repeats)."""
    if fault != 0 and b.fault_offset < 0:
        b.fault_offset = <Py_ssize_t>(fault - <uintptr_t>b.ptr)
    if b.fault_offset >= 0 and b.fault_message is None:
        b.fault_message = _truncated_message(path, b, what)
    return 0


cdef int poisoned(_Block b) except -1:
    """Raise the mapping's FormatError if a guarded read has met a truncation in it (see MappedFile.guard);
    every view made from then on would read zeros where the file's bytes were."""
    if b.fault_offset < 0 and b.cell != NULL and fc_cell_fault(<fc_cell*>b.cell) != 0:
        _note_fault(b, fc_cell_fault(<fc_cell*>b.cell), b.fault_path, "the file")
    if b.fault_message is not None:
        raise FormatError(b.fault_message)
    return 0


cdef int guard_check() except -1:
    """Check with a system call that the SIGBUS handler is installed, putting it back in front if something
    replaced it (``faulthandler.enable()``, ``signal.signal``, C code)."""
    if fc_guard_install() != 0:
        e = errno
        raise OSError(e, f"cannot install the SIGBUS handler: {strerror(e).decode()}")
    return 0


cdef int guard_enter(_Block b, object path, object what, void** hold, int check=-1) except -1:
    """Open a guard of this thread over ``b`` (see :meth:`MappedFile.guard`); ``hold[0]`` is what
    :func:`guard_exit` takes. Raises at once if the mapping already met a truncation.

    A no-op (``hold[0]`` NULL) for memory that is not a file's mapping (what ``from_buffer`` holds). Runs
    :func:`guard_check` (a system call) when ``check`` is 1, never when it is 0 (a loop that checked before
    it), and by default (-1) when the mapping has no guard open yet: a guard nested in another over the same
    mapping costs no system call."""
    cdef fc_cell* cell
    cdef fc_hold* h
    hold[0] = NULL
    if not b.is_mmap or b.ptr == NULL:
        return 0
    if b.fault_message is not None or (b.cell != NULL and fc_cell_fault(<fc_cell*>b.cell) != 0):
        _note_fault(b, fc_cell_fault(<fc_cell*>b.cell) if b.cell != NULL else 0, path, what)
        raise FormatError(b.fault_message)
    if check == 1 or (check < 0 and b.guards == 0):
        guard_check()
    cell = <fc_cell*>b.cell
    if cell == NULL:
        cell = fc_cell_claim(<uintptr_t>b.ptr, <uintptr_t>b.ptr + <uintptr_t>b.size,
                             PROT_READ | (PROT_WRITE if b.writable else 0))
        if cell == NULL:
            raise MemoryError("no memory for a truncation guard")
    h = fc_hold_claim(cell, <PyObject*>b, <PyObject*>path, <PyObject*>what)
    if h == NULL:
        if b.cell == NULL:
            fc_cell_release(cell)
        raise MemoryError("no memory for a truncation guard")
    if b.cell == NULL:
        b.cell = <void*>cell
        b.fault_path = path
    b.guards += 1
    hold[0] = <void*>h
    return 0


cdef int guard_poll(_Block b, object path, object what) except -1:
    """Raise if a read under the open guards of ``b`` has met a truncated file."""
    if b.cell != NULL:
        _note_fault(b, fc_cell_fault(<fc_cell*>b.cell), path, what)
    if b.fault_message is not None:
        raise FormatError(b.fault_message)
    return 0


cdef void _release(_Block b, void* hold) noexcept:
    """Free a hold and, with the mapping's last guard, its cell (remembering a fault met under them). No Python
    is called, so that a guard object's finalizer can use it at shutdown."""
    cdef uintptr_t fault
    fc_hold_release(<fc_hold*>hold)
    b.guards -= 1
    if b.guards == 0 and b.cell != NULL:
        fault = fc_cell_fault(<fc_cell*>b.cell)
        if fault != 0 and b.fault_offset < 0:
            b.fault_offset = <Py_ssize_t>(fault - <uintptr_t>b.ptr)
        fc_cell_release(<fc_cell*>b.cell)
        b.cell = NULL


cdef int guard_exit(_Block b, void* hold, object path, object what) except -1:
    """Close a guard that :func:`guard_enter` opened; raises if a read under it met a truncated file."""
    cdef uintptr_t fault = 0
    if hold == NULL:
        return 0
    if b.cell != NULL:
        fault = fc_cell_fault(<fc_cell*>b.cell)
    _release(b, hold)
    if fault != 0 or b.fault_offset >= 0:
        _note_fault(b, fault, path, what)
        raise FormatError(b.fault_message)
    return 0


cdef class _Guard:
    """What :meth:`MappedFile.guard` returns: a context manager over one mapping (a no-op without one). It may
    be entered again while entered (the holds stack up) and left in another thread than the one that entered."""

    cdef _Block _block
    cdef object _path
    cdef object _what
    cdef void* _hold      # the innermost entry's hold
    cdef list _outer      # holds of entries it is nested in (as ints), None when entered once

    def __enter__(self):
        cdef void* h
        if self._block is not None:
            guard_enter(self._block, self._path, self._what, &h)
            if self._hold != NULL:
                if self._outer is None:
                    self._outer = []
                self._outer.append(<uintptr_t>self._hold)
            self._hold = h
        return self

    def check(self):
        """Raise now if a read under this guard has met a truncated file (work that must not finish on zeros,
        a write about to commit, polls it)."""
        if self._block is not None:
            guard_poll(self._block, self._path, self._what)

    def __exit__(self, exc_type, exc, tb):
        cdef _Block b = self._block
        cdef void* h = self._hold
        if h == NULL:
            return False
        if self._outer:
            self._hold = <void*><uintptr_t>self._outer.pop()
        else:
            self._hold = NULL
        if (isinstance(exc, OSError) and exc.errno == EFAULT and b.fault_offset < 0
                and _size_now(self._path) < b.size):
            # A system call handed the mapping (writev of its views) met the truncation: the kernel says
            # EFAULT instead of sending SIGBUS. The same FormatError, and the mapping remembers it.
            b.fault_offset = _size_now(self._path)
        guard_exit(b, h, self._path, self._what)
        return False

    def __dealloc__(self):
        # Entered and never left (the object leaked in a cycle): give its holds back. No Python here.
        cdef uintptr_t h
        if self._block is None:
            return
        if self._hold != NULL:
            _release(self._block, self._hold)
            self._hold = NULL
        if self._outer is not None:
            for h in self._outer:
                _release(self._block, <void*>h)
            self._outer = None


cdef class GuardScope:
    """The guards a thread holds, to be held again by a worker thread that copies for it: what
    :func:`held_guards` returns.

    A copy out of a mapping is covered by the guards of the thread that makes it (and, for threads that are
    not Python threads, by any thread's: the OpenCL runtime's and BLAKE3's workers). A Python worker thread
    that copies for a guarded call runs under the caller's scope: ``pool.submit(scope.run, fn, *args)``. A
    truncation met there raises the mapping's FormatError when ``fn`` returns, as the guards themselves do.

    >>> import tempfile, os
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, b"x" * 8192); os.close(fd)
    >>> m = MappedFile(p)
    >>> with m.guard("the test bytes"), ThreadPoolExecutor(1) as pool:
    ...     scope = held_guards()
    ...     pool.submit(scope.run, bytes, m.view(0, 4)).result(), len(scope)
    (b'xxxx', 1)
    """

    cdef list _held      # (block, path, what) for each mapping

    def __len__(self):
        return len(self._held)

    def run(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` in the calling thread, under guards of its own over the scope's mappings.
        Several threads may run under one scope at once."""
        cdef void* h
        cdef list holds = []
        cdef Py_ssize_t i
        try:
            for block, path, what in self._held:
                guard_enter(<_Block>block, path, what, &h)
                holds.append(<uintptr_t>h)
            return fn(*args, **kwargs)
        finally:
            error = None
            for i in range(len(holds)):
                block, path, what = self._held[i]
                try:
                    guard_exit(<_Block>block, <void*><uintptr_t>holds[i], path, what)
                except FormatError as e:
                    error = error or e
            if error is not None:
                raise error


def _pause_after_patch(int state):
    """For tests of the guard's races: 1 arms a pause in the SIGBUS handler right after it maps the zero pages
    (the next guarded fault waits there, and ``_pause_after_patch(-1)`` then says 2), 0 lets it go and disarms.
    Returns the state before the call."""
    return fc_pause_set(state)


def held_guards():
    """The guards over mappings (:meth:`MappedFile.guard`) that the calling thread holds now, as a
    :class:`GuardScope` that worker threads enter for the copies they make on this thread's behalf."""
    cdef GuardScope scope = GuardScope.__new__(GuardScope)
    cdef list found = []
    cdef set seen = set()
    fc_held_by_this_thread(found)
    scope._held = []
    for block, path, what in found:
        if id(block) not in seen:
            seen.add(id(block))
            scope._held.append((block, path, what))
    return scope


cdef Py_ssize_t _size_now(object path):
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


cdef str _truncated_message(object path, _Block block, object what):
    try:
        now = f"now has {os.stat(path).st_size} bytes"
    except OSError as e:
        now = f"is gone ({e.strerror})"
    return (
        f"{path}: the file was truncated or replaced while reading {what} (or its storage failed): byte "
        f"{block.fault_offset} of its {block.size}-byte mapping is no longer in the file, which {now}. Every "
        "read through this handle now raises this error (its pages from there on read as zeros). Open it "
        "again once whatever writes it has finished (fastckpt's writers replace files by rename, which never "
        "does this); on a filesystem where files change under a reader, open it with backend='pread'")


cdef _Block _aligned_block(Py_ssize_t size):
    cdef _Block block = _Block()
    cdef void* p = NULL
    if size > 0:
        if posix_memalign(&p, 4096, <size_t>size) != 0:
            raise MemoryError(f"could not allocate {size} bytes")
        block.ptr = <uint8_t*>p
        block.size = size
    block.writable = True
    return block


cdef class MappedFile:
    """A read-only (or copy-on-write) memory map of a whole file.

    >>> import tempfile, os
    >>> fd, p = tempfile.mkstemp(); os.write(fd, b"hello world"); os.close(fd)
    11
    >>> with MappedFile(p) as m:
    ...     bytes(m.view(6, 5))
    b'world'
    """

    def __cinit__(self):
        self._fd = -1
        self._scratch = NULL
        self._scratch_cap = 0
        self._closed = True
        self._reads_in_flight = 0

    def __init__(self, path, *, backend="mmap", copy_on_write=False, advise=True, populate=False):
        cdef int fd
        cdef int prot
        cdef int mflags
        cdef void* p
        if backend not in ("mmap", "pread"):
            raise ValueError(f"backend must be 'mmap' or 'pread', got {backend!r}")
        self.path = os.fspath(path)
        self.backend = backend
        self.copy_on_write = bool(copy_on_write)
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)  # OSError keeps its errno
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if backend == "pread":
                self._fd = fd
                fd = -1
            else:
                self._block = _Block()
                self._block.writable = self.copy_on_write
                self._block.is_mmap = True
                if self.size > 0:
                    prot = PROT_READ | (PROT_WRITE if self.copy_on_write else 0)
                    mflags = MAP_PRIVATE | (MAP_POPULATE if populate else 0)
                    with nogil:
                        p = mmap(NULL, <size_t>self.size, prot, mflags, fd, 0)
                    if p == MAP_FAILED:
                        e = errno
                        raise OSError(e, f"cannot map {self.path!r} ({strerror(e).decode()}); "
                                         "open it with backend='pread' on filesystems that cannot mmap", self.path)
                    self._block.ptr = <uint8_t*>p
                    self._block.size = self.size
                    if advise:
                        madvise(p, <size_t>self.size, MADV_SEQUENTIAL)
                        madvise(p, <size_t>self.size, MADV_WILLNEED)
        finally:
            if fd >= 0:
                os.close(fd)
        self._closed = False

    @staticmethod
    def from_buffer(data, path="<bytes>"):
        """A handle over a private copy of the bytes of ``data`` (``bytes``, ``bytearray``, a contiguous ``memoryview``).

        The parsers read it as they read a file (``path`` names it in their
        error messages). The copy is page-aligned and writable (``backend`` is
        ``"memory"``, ``copy_on_write`` True), so arrays viewed in it are aligned,
        writable and independent of ``data``; they keep the copy alive.

        >>> m = MappedFile.from_buffer(bytearray(b"hello world"))
        >>> bytes(m.view(6, 5)), m.address % 4096, m
        (b'world', 0, <MappedFile '<bytes>' size=11 backend='memory' copy_on_write>)
        """
        cdef Py_buffer source
        cdef MappedFile m = MappedFile.__new__(MappedFile)
        PyObject_GetBuffer(data, &source, PyBUF_SIMPLE)  # BufferError for non-contiguous data
        try:
            m._block = _aligned_block(source.len)
            if source.len:
                memcpy(m._block.ptr, source.buf, <size_t>source.len)
            m.size = source.len
        finally:
            PyBuffer_Release(&source)
        m.path = path
        m.backend = "memory"
        m.copy_on_write = True
        m._closed = False
        return m

    def __dealloc__(self):
        if self._fd >= 0:
            close(self._fd)
            self._fd = -1
        if self._scratch != NULL:
            PyMem_Free(self._scratch)
            self._scratch = NULL

    # -- lifetime -------------------------------------------------------------------------------

    def close(self):
        """Release this handle. Idempotent; views already handed out stay valid.

        Needs no Python module (safe from ``__del__`` at interpreter shutdown). A pread
        in flight in another thread keeps the descriptor open until it returns.
        """
        if self._closed:
            return
        self._closed = True
        self._block = None
        if self._reads_in_flight == 0:
            self._release_fd()
        # The scratch buffer stays until __dealloc__: a parser in another thread may still hold a
        # span() pointer into it.

    cdef void _release_fd(self) noexcept:
        cdef int fd = self._fd
        self._fd = -1
        if fd >= 0:
            close(fd)

    @property
    def closed(self):
        """True once :meth:`close` has run."""
        return self._closed

    @property
    def valid(self):
        """True while the handle is open."""
        return not self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self._closed:
            return "<Closed MappedFile>"
        return f"<MappedFile {self.path!r} size={self.size} backend={self.backend!r}{' copy_on_write' if self.copy_on_write else ''}>"

    # -- reads ---------------------------------------------------------------------------------

    cdef int _check(self, Py_ssize_t offset, Py_ssize_t length, object what) except -1:
        if self._closed:
            raise ValueError(f"{self.path!r}: the mapped file is closed")
        if self._block is not None and (self._block.fault_message is not None or self._block.cell != NULL):
            poisoned(self._block)  # a guarded read met a truncation: nothing read from here on is the file's
        if offset < 0 or length < 0 or offset > self.size or length > self.size - offset:
            end = offset + length
            raise FormatError(
                f"{self.path}: {what} needs bytes [{offset}, {end}) but the file has {self.size} bytes "
                f"(expected {length} bytes at offset {offset}, got {max(0, min(self.size - offset, length))}; "
                "file seems truncated?)")
        return 0

    cdef const uint8_t* span(self, Py_ssize_t offset, Py_ssize_t length, object what) except NULL:
        """Pointer to ``length`` checked bytes at ``offset``; valid until the next span() call (pread)."""
        cdef void* grown
        self._check(offset, length, what)
        if length == 0:
            return _EMPTY
        if self._block is not None:
            return self._block.ptr + offset
        if length > self._scratch_cap:
            grown = PyMem_Malloc(<size_t>length)
            if grown == NULL:
                raise MemoryError(f"could not allocate {length} bytes")
            if self._scratch != NULL:
                PyMem_Free(self._scratch)
            self._scratch = <uint8_t*>grown
            self._scratch_cap = length
        self._pread_into(self._scratch, offset, length, what)
        return self._scratch

    cdef int _pread_into(self, uint8_t* dst, Py_ssize_t offset, Py_ssize_t length, object what) except -1:
        cdef ssize_t got
        cdef int err = 0
        cdef Py_ssize_t done = 0
        cdef int fd
        # Checked again here, not only by the caller: anything between (an allocation running a
        # finalizer) may have let another thread close the file. From this check on the GIL is held
        # until the count below keeps close() from closing fd while a pread has dropped the GIL.
        if self._closed or self._fd < 0:
            raise ValueError(f"{self.path!r}: the mapped file is closed")
        fd = self._fd
        self._reads_in_flight += 1
        try:
            while done < length:
                with nogil:
                    got = pread(fd, dst + done, <size_t>(length - done), offset + done)
                    if got < 0:
                        err = errno
                if got < 0:
                    if err == EINTR:
                        continue
                    raise OSError(err, f"{self.path}: reading {what} at offset {offset + done}: "
                                       f"{strerror(err).decode()}", self.path)
                if got == 0:
                    raise FormatError(f"{self.path}: {what}: expected {length} bytes at offset {offset}, got {done} "
                                      "(the file shrank while open?)")
                done += got
        finally:
            self._reads_in_flight -= 1
            if self._reads_in_flight == 0 and self._closed:
                self._release_fd()  # close() came while this read ran: it left the descriptor to us
        return 0

    def read(self, Py_ssize_t offset, Py_ssize_t length, what="bytes"):
        """Copy ``length`` bytes at ``offset`` into a new ``bytes`` object.

        >>> import tempfile, os
        >>> fd, p = tempfile.mkstemp(); os.write(fd, b"hello world"); os.close(fd)
        11
        >>> MappedFile(p, backend="pread").read(0, 5)
        b'hello'
        """
        cdef bytes out
        cdef _Block block
        cdef void* hold
        self._check(offset, length, what)
        if self._block is not None:
            if not length:
                return b""
            block = self._block
            guard_enter(block, self.path, what, &hold)  # within a parse's guard: no system call
            try:
                return (<const char*>block.ptr)[offset:offset + length]
            finally:
                guard_exit(block, hold, self.path, what)
        # Straight into the result, not through span()'s shared scratch buffer: read() may run in
        # several threads at once.
        out = PyBytes_FromStringAndSize(NULL, length)
        if length:
            self._pread_into(<uint8_t*>PyBytes_AS_STRING(out), offset, length, what)
        return out

    def view(self, Py_ssize_t offset=0, length=None, what="bytes"):
        """A ``memoryview`` of ``length`` bytes at ``offset`` (to the end when ``length`` is None).

        Zero-copy for ``backend="mmap"``; read-only unless the file was opened with
        ``copy_on_write=True``. The view keeps the mapping alive after :meth:`close`.
        """
        cdef Py_ssize_t n
        cdef _Block block
        if length is None:
            if self._closed:
                raise ValueError(f"{self.path!r}: the mapped file is closed")
            n = self.size - offset
        else:
            n = length
        self._check(offset, n, what)
        if self._block is not None:
            return memoryview(self._block)[offset:offset + n]
        block = _aligned_block(n)
        block.writable = self.copy_on_write
        if n:
            self._pread_into(block.ptr, offset, n, what)
        return memoryview(block)

    def array(self, Py_ssize_t offset, dtype, shape, order="C", what="tensor"):
        """A numpy array of ``dtype`` and ``shape`` over the bytes at ``offset`` (zero-copy for mmap).

        ``order="F"`` interprets the bytes in Fortran (column-major) order. The array
        is read-only unless the file was opened copy-on-write, and may be unaligned
        (numpy handles that; ``arr.flags.aligned`` says so). Its ``base`` keeps the
        mapping alive.

        >>> import tempfile, os, numpy as np
        >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, np.arange(6, dtype="<i2").tobytes()); os.close(fd)
        >>> MappedFile(p).array(2, "<i2", (2, 2), order="F").tolist()
        [[1, 3], [2, 4]]
        """
        cdef cnp.npy_intp dims[_MAX_DIMS]
        cdef Py_ssize_t nbytes, d
        cdef int nd, i, flags
        cdef _Block block
        cdef uint8_t* base
        dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        if dt.hasobject:
            raise ValueError(f"{self.path}: {what}: dtype {dt} holds Python objects, which raw file bytes never are")
        shp = shape if type(shape) is tuple else tuple(shape)
        nd = len(shp)
        if nd > _MAX_DIMS:
            raise FormatError(f"{self.path}: {what}: {nd} dimensions; numpy allows at most {_MAX_DIMS}")
        nbytes = dt.itemsize
        for i in range(nd):
            d = shp[i]
            if d < 0:
                raise FormatError(f"{self.path}: {what}: negative dimension in shape {shp}")
            if d != 0 and nbytes > PY_SSIZE_T_MAX // d:
                raise FormatError(f"{self.path}: {what}: shape {shp} of {dt} spans more bytes than memory can address")
            nbytes *= d
            dims[i] = d
        for i in range(nd):
            if dims[i] == 0:
                nbytes = 0
        self._check(offset, nbytes, what)
        block = self._block
        if block is None:  # pread backend: a private copy of the bytes
            arr = np.frombuffer(self.view(offset, nbytes, what), dtype=dt, count=nbytes // dt.itemsize if dt.itemsize else 0)
            return arr.reshape(tuple(int(x) for x in shp), order="F" if order == "F" else "C")
        base = block.ptr if block.ptr != NULL else _EMPTY
        flags = cnp.NPY_ARRAY_F_CONTIGUOUS if order == "F" else cnp.NPY_ARRAY_C_CONTIGUOUS
        if block.writable:
            flags |= cnp.NPY_ARRAY_WRITEABLE
        # SAFETY: the array points into the mapping; its base holds the block that owns the mapping,
        # so the pages stay mapped for as long as the array (or any view of it) lives.
        Py_INCREF(dt)  # PyArray_NewFromDescr steals a reference to the descriptor
        arr = _new_array(<PyTypeObject*>np.ndarray, <_Descr*>dt, nd, dims, NULL, <void*>(base + offset),
                         flags, NULL)
        cnp.set_array_base(arr, block)
        return arr

    def guard(self, what="the file"):
        """A context manager under which reads of the mapping that meet a truncated file raise, instead of
        killing the process with SIGBUS.

        Every copy fastckpt makes out of a mapping (host copies, device loads, staging fills, hashing,
        conversions) runs under it: a page that is no longer in the file reads as zeros and, on leaving the
        block, :class:`~fastckpt.errors.FormatError` names the file and says it was "truncated or replaced
        while reading" ``what``. The mapping remembers it: every later guard, ``view``, ``array`` and
        ``read`` of it raises the same error at once (its pages from the first missing one on now read as
        zeros, so nothing read from it can be trusted). Views made before stay plain mapped memory and read
        those zeros; ``backend="pread"`` makes copies instead. A no-op for the pread and memory backends.

        A guard covers the thread that entered it, and the worker threads of native runtimes (threads
        without a Python thread state: BLAKE3's, the OpenCL runtime's) while it is held; a Python worker
        thread that copies for the guarded call runs under :func:`held_guards`. A fault anywhere else, a
        plain view read in another Python thread included, and every SIGBUS sent with ``kill``, goes to the
        handler installed before the guard's (a ``signal.signal`` handler, a C handler, ``faulthandler``, or
        the default action, which ends the process), every time; entering a guard puts the guard's handler
        back in front if something replaced it. There is no limit on how many mappings are guarded at once.
        Guards nest, may be held by several threads at once, and cost no system call when nested in a guard
        over the same mapping.

        >>> import tempfile, os
        >>> fd, p = tempfile.mkstemp(); _ = os.write(fd, b"x" * 8192); os.close(fd)
        >>> m = MappedFile(p)
        >>> with m.guard("the test bytes"):
        ...     os.truncate(p, 0)
        ...     _ = bytes(m.view(4096, 16))
        Traceback (most recent call last):
        ...
        fastckpt.errors.FormatError: ...: the file was truncated or replaced while reading the test bytes (or its storage failed): ...
        """
        cdef _Guard g = _Guard.__new__(_Guard)
        if self._block is not None and self._block.is_mmap and self._block.ptr != NULL:
            g._block = self._block
        g._path = self.path
        g._what = what
        return g

    def advise(self, kind, Py_ssize_t offset=0, length=None):
        """Pass ``madvise`` advice (``"sequential"``, ``"willneed"``, ``"random"``, ``"dontneed"``, ``"normal"``)
        for a byte range. A no-op for the pread backend."""
        cdef Py_ssize_t start
        cdef Py_ssize_t n
        if kind not in _ADVICE:
            raise ValueError(f"advice must be one of {sorted(_ADVICE)}, got {kind!r}")
        n = self.size - offset if length is None else length
        self._check(offset, n, "advice range")
        if self._block is None or n == 0:
            return
        start = offset - (offset % PAGE_SIZE)
        if madvise(self._block.ptr + start, <size_t>(n + offset - start), _ADVICE[kind]) != 0:
            e = errno
            raise OSError(e, f"madvise({kind}) failed: {strerror(e).decode()}")

    @property
    def address(self):
        """Base address of the mapping (for alignment checks), or None for the pread backend or an empty file."""
        if self._closed or self._block is None or self._block.ptr == NULL:
            return None
        return <uintptr_t>self._block.ptr


# Kept memory: large buffers (2 MiB on) whose pages a process frees and allocates again load after load, so that a
# repeated load pays no page fault and no zeroing by the kernel. One list for the whole process: the id index's
# buckets (idindex.pyx, through kept_alloc / kept_free) and the arrays a sharded load fills (fastckpt.sharded.kept,
# through kept_take / kept_give) draw on it.
#
# A buffer from 2 MiB on is a private anonymous mapping of its own, aligned to 2 MiB and advised to use huge pages,
# its size rounded up to a multiple of 2 MiB (so that loads of slightly other sizes reuse it). Freed, it is kept
# for the next buffer of the same rounded size, up to fastckpt_kept_limit bytes in all (at most FASTCKPT_KEPT_SLOTS
# buffers), its pages given back with MADV_FREE: the kernel takes them when it needs memory (they read as zeros
# then, and fault again). Where a freed buffer does not fit, the buffers kept longest are unmapped to make room (a
# process whose loads change shape, a reshard after a same-shape load, keeps the sizes it uses now); one larger
# than the limit is unmapped. Below 2 MiB a buffer is malloc's (calloc's where it
# must be zero), which keeps small blocks itself. Every call holds the GIL, which is what guards the list (no lock
# of its own, so a fork never finds one held): kept_alloc and kept_free are declared without nogil.
cdef extern from *:
    """
    #include <stdlib.h>
    #include <string.h>
    #include <sys/mman.h>
    #define FASTCKPT_KEPT_HUGE ((size_t)2 << 20)
    #define FASTCKPT_KEPT_SLOTS 128
    static size_t fastckpt_kept_limit = (size_t)512 << 20;
    static void* fastckpt_kept_addr[FASTCKPT_KEPT_SLOTS];
    static size_t fastckpt_kept_size[FASTCKPT_KEPT_SLOTS];
    static unsigned long long fastckpt_kept_age[FASTCKPT_KEPT_SLOTS];  /* when it was kept: larger is later */
    static unsigned long long fastckpt_kept_clock = 0;
    static size_t fastckpt_kept_total = 0;
    static size_t fastckpt_kept_round(size_t nbytes) {
        return (nbytes + FASTCKPT_KEPT_HUGE - 1) & ~(FASTCKPT_KEPT_HUGE - 1);
    }
    static void* fastckpt_kept_alloc(size_t nbytes, int zero) {
        if (nbytes < FASTCKPT_KEPT_HUGE)
            return zero ? calloc(nbytes ? nbytes : 1, 1) : malloc(nbytes ? nbytes : 1);
        size_t size = fastckpt_kept_round(nbytes);
        for (int i = 0; i < FASTCKPT_KEPT_SLOTS; i++) {
            if (fastckpt_kept_addr[i] != NULL && fastckpt_kept_size[i] == size) {
                void* kept = fastckpt_kept_addr[i];
                fastckpt_kept_addr[i] = NULL;
                fastckpt_kept_total -= size;
                if (zero)
                    memset(kept, 0, nbytes);
                return kept;
            }
        }
        size_t span = size + FASTCKPT_KEPT_HUGE;  /* room to start on a 2 MiB boundary */
        char* p = (char*)mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return NULL;
        size_t head = (FASTCKPT_KEPT_HUGE - ((size_t)p & (FASTCKPT_KEPT_HUGE - 1))) & (FASTCKPT_KEPT_HUGE - 1);
        if (head)
            munmap(p, head);
        size_t tail = span - head - size;
        if (tail)
            munmap(p + head + size, tail);
    #ifdef MADV_HUGEPAGE
        madvise(p + head, size, MADV_HUGEPAGE);  /* advice only: without it the buffer still works */
    #endif
        return p + head;  /* a new mapping's pages are zeros */
    }
    static void fastckpt_kept_free(void* p, size_t nbytes) {
        if (p == NULL)
            return;
        if (nbytes < FASTCKPT_KEPT_HUGE) {
            free(p);
            return;
        }
        size_t size = fastckpt_kept_round(nbytes);
        if (size > fastckpt_kept_limit) {
            munmap(p, size);
            return;
        }
        /* Room for it: the buffers kept longest go first (the sizes a process loads now are the likeliest again). */
        for (;;) {
            int free_slot = -1, oldest = -1;
            for (int i = 0; i < FASTCKPT_KEPT_SLOTS; i++) {
                if (fastckpt_kept_addr[i] == NULL) {
                    if (free_slot < 0)
                        free_slot = i;
                } else if (oldest < 0 || fastckpt_kept_age[i] < fastckpt_kept_age[oldest]) {
                    oldest = i;
                }
            }
            if (free_slot >= 0 && fastckpt_kept_total + size <= fastckpt_kept_limit) {
    #ifdef MADV_FREE
                madvise(p, size, MADV_FREE);
    #endif
                fastckpt_kept_addr[free_slot] = p;
                fastckpt_kept_size[free_slot] = size;
                fastckpt_kept_age[free_slot] = ++fastckpt_kept_clock;
                fastckpt_kept_total += size;
                return;
            }
            munmap(fastckpt_kept_addr[oldest], fastckpt_kept_size[oldest]);
            fastckpt_kept_total -= fastckpt_kept_size[oldest];
            fastckpt_kept_addr[oldest] = NULL;
        }
    }
    static void fastckpt_kept_set_limit(size_t limit) {
        fastckpt_kept_limit = limit;
    }
    static void fastckpt_kept_release(void) {
        for (int i = 0; i < FASTCKPT_KEPT_SLOTS; i++) {
            if (fastckpt_kept_addr[i] != NULL) {
                munmap(fastckpt_kept_addr[i], fastckpt_kept_size[i]);
                fastckpt_kept_addr[i] = NULL;
            }
        }
        fastckpt_kept_total = 0;
    }
    """
    size_t FASTCKPT_KEPT_HUGE
    size_t fastckpt_kept_limit
    size_t fastckpt_kept_total
    void* fastckpt_kept_alloc(size_t nbytes, int zero)
    void fastckpt_kept_free(void* p, size_t nbytes)
    void fastckpt_kept_set_limit(size_t limit)
    void fastckpt_kept_release()


cdef void* kept_alloc(size_t nbytes, bint zero) noexcept:
    return fastckpt_kept_alloc(nbytes, zero)


cdef void kept_free(void* p, size_t nbytes) noexcept:
    fastckpt_kept_free(p, nbytes)


#: Buffers from this size on are mappings of their own, kept when freed; smaller ones are malloc's.
KEPT_MIN_BYTES = FASTCKPT_KEPT_HUGE


def kept_take(Py_ssize_t nbytes):
    """The address of ``nbytes`` of writable memory (from ``KEPT_MIN_BYTES`` on: a kept buffer of the same rounded
    size where there is one, its bytes whatever they were; else a new mapping), or 0 where none can be had. Give
    it back with :func:`kept_give` and the same ``nbytes``.

    >>> address = kept_take(4 << 20); address % (2 << 20), kept_give(address, 4 << 20)
    (0, None)
    """
    if nbytes < 0:
        raise ValueError(f"kept_take: nbytes must be >= 0, got {nbytes}")
    return <uintptr_t>fastckpt_kept_alloc(<size_t>nbytes, 0)


def kept_give(uintptr_t address, Py_ssize_t nbytes):
    """Give back what :func:`kept_take` returned for ``nbytes``: kept for the next buffer of its size (within
    :func:`kept_limit`), else unmapped. No view of it may be used afterwards."""
    fastckpt_kept_free(<void*>address, <size_t>nbytes)


def kept_bytes():
    """The bytes of freed buffers kept now, every user's together.

    >>> kept_bytes() >= 0
    True
    """
    return fastckpt_kept_total


def kept_limit(limit=None):
    """The most bytes of freed buffers kept at once (512 MiB unless set); ``limit`` sets it (0: keep none) and
    unmaps what is kept. Returns the limit in force before the call.

    >>> old = kept_limit(64 << 20); kept_limit(old) == 64 << 20
    True
    """
    cdef size_t before = fastckpt_kept_limit
    if limit is not None:
        if limit < 0:
            raise ValueError(f"kept_limit: the limit must be >= 0, got {limit}")
        fastckpt_kept_set_limit(<size_t>limit)
        fastckpt_kept_release()
    return before


def kept_release():
    """Unmap every kept buffer (those in use are not touched).

    >>> kept_release(); kept_bytes()
    0
    """
    fastckpt_kept_release()
