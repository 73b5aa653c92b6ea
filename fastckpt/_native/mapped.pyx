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
  ("truncated or replaced while reading"). Views handed out are plain mapped
  memory: after such a truncation, reading one kills the process as any
  mapping would (``backend="pread"`` hands out copies instead).

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



# The truncation guard (see MappedFile.guard): a SIGBUS handler that, for a fault inside a mapping some thread
# is reading under a guard, maps a zero page over the faulting page, records the first faulting address and
# returns, so the copy (numpy's, BLAKE3's threads', the OpenCL runtime's) runs to its end and the guard's exit
# raises. Patching rather than jumping out (sigsetjmp/siglongjmp) is what reaches copies made by threads that
# fastckpt does not own; the handler touches only this table (lock-free, fixed size) and the mmap syscall.
cdef extern from *:
    """
    #include <signal.h>
    #include <stdint.h>
    #include <string.h>
    #include <sys/mman.h>
    #include <unistd.h>

    #define FC_GUARD_SLOTS 1024
    typedef struct { uintptr_t start, end, fault; int prot; int active; } fc_guard_slot;
    static fc_guard_slot fc_guard_slots[FC_GUARD_SLOTS];
    static struct sigaction fc_guard_previous;
    static uintptr_t fc_guard_page = 4096;
    static int fc_guard_installed = 0;
    static volatile sig_atomic_t fc_guard_chained = 0;

    static void fc_guard_handler(int sig, siginfo_t *info, void *context) {
        uintptr_t addr = (uintptr_t)info->si_addr;
        int i;
        if (info->si_code > 0) {  /* a fault, not a kill() */
            for (i = 0; i < FC_GUARD_SLOTS; i++) {
                fc_guard_slot *s = &fc_guard_slots[i];
                if (__atomic_load_n(&s->active, __ATOMIC_ACQUIRE) && addr >= s->start && addr < s->end) {
                    uintptr_t page = addr & ~(fc_guard_page - 1);
                    uintptr_t end = (s->end + fc_guard_page - 1) & ~(fc_guard_page - 1);
                    uintptr_t none = 0;
                    /* A truncation takes every page from here to the end: patch them all at once rather than
                       take one signal per page (the mapping is dead from now on anyway). */
                    if (mmap((void *)page, end - page, s->prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                             -1, 0) == MAP_FAILED)
                        break;  /* cannot patch: die as an unguarded fault would */
                    __atomic_compare_exchange_n(&s->fault, &none, addr, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
                    return;  /* the access runs again and reads zeros */
                }
            }
        }
        /* Not ours: give the signal to whoever handled it before (the default action kills the process, as
           without fastckpt). The fault happens again on return and goes there; a sent signal is sent again.
           Back here a second time (faulthandler, enabled after this handler, restores it and raises again once
           it has written its report): end as the default action does, rather than pass it round forever. */
        if (fc_guard_chained) {
            struct sigaction dfl;
            memset(&dfl, 0, sizeof dfl);
            dfl.sa_handler = SIG_DFL;
            sigemptyset(&dfl.sa_mask);
            sigaction(SIGBUS, &dfl, NULL);
            raise(SIGBUS);
            return;
        }
        fc_guard_chained = 1;
        sigaction(SIGBUS, &fc_guard_previous, NULL);
        if (info->si_code <= 0)
            raise(SIGBUS);
    }

    /* Installs the handler unless it is the current one (faulthandler, enabled later, may have replaced it). */
    static int fc_guard_install(void) {
        struct sigaction current, mine;
        if (sigaction(SIGBUS, NULL, &current) != 0)
            return -1;
        if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == fc_guard_handler)
            return 0;
        memset(&mine, 0, sizeof mine);
        mine.sa_sigaction = fc_guard_handler;
        mine.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&mine.sa_mask);
        fc_guard_page = (uintptr_t)sysconf(_SC_PAGESIZE);
        fc_guard_previous = current;
        if (sigaction(SIGBUS, &mine, NULL) != 0)
            return -1;
        fc_guard_installed = 1;
        return 0;
    }

    /* fc_guard_install the first time only: for native loops that open a guard per tensor, where a system
       call each would cost more than the read (MappedFile.guard() checks every time). */
    static int fc_guard_ensure(void) {
        return fc_guard_installed ? 0 : fc_guard_install();
    }

    /* A free slot for [start, end), or -1 when every slot is taken. Called with the GIL held. */
    static int fc_guard_claim(uintptr_t start, uintptr_t end, int prot) {
        int i;
        for (i = 0; i < FC_GUARD_SLOTS; i++) {
            fc_guard_slot *s = &fc_guard_slots[i];
            if (!__atomic_load_n(&s->active, __ATOMIC_ACQUIRE)) {
                s->start = start; s->end = end; s->prot = prot;
                __atomic_store_n(&s->fault, 0, __ATOMIC_RELAXED);
                __atomic_store_n(&s->active, 1, __ATOMIC_RELEASE);
                return i;
            }
        }
        return -1;
    }

    static uintptr_t fc_guard_fault(int i) {
        return __atomic_load_n(&fc_guard_slots[i].fault, __ATOMIC_ACQUIRE);
    }

    /* Frees the slot; returns the first faulting address seen in it (0: none). */
    static uintptr_t fc_guard_release(int i) {
        uintptr_t fault;
        __atomic_store_n(&fc_guard_slots[i].active, 0, __ATOMIC_RELEASE);
        fault = __atomic_load_n(&fc_guard_slots[i].fault, __ATOMIC_ACQUIRE);
        return fault;
    }
    """
    int fc_guard_install() nogil
    int fc_guard_ensure() nogil
    int fc_guard_claim(uintptr_t start, uintptr_t end, int prot) nogil
    uintptr_t fc_guard_fault(int i) nogil
    uintptr_t fc_guard_release(int i) nogil

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
        self.guard_slot = -1
        self.guards = 0
        self.fault_offset = -1

    def __dealloc__(self):
        # No Python here: this may run at interpreter shutdown.
        if self.guard_slot >= 0:  # a guard still open (its object leaked in a cycle): free the slot first
            fc_guard_release(self.guard_slot)
            self.guard_slot = -1
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


cdef int guard_enter(_Block b, object path, object what, bint reinstall=False) except -1:
    """Open a guard over ``b`` (see :meth:`MappedFile.guard`); raises at once if the mapping already met a truncation.

    A no-op for memory that is not a file's mapping (what ``from_buffer`` holds). The SIGBUS handler is
    installed the first time; ``reinstall`` checks with a system call that it still is (``faulthandler.enable()``
    may have replaced it since): ``MappedFile.guard()`` does, native loops that guard each tensor do not."""
    if not b.is_mmap or b.ptr == NULL:
        return 0
    if b.fault_offset >= 0:
        _raise_truncated(path, b, what)
    if b.guards == 0:
        if (fc_guard_install() if reinstall else fc_guard_ensure()) != 0:
            e = errno
            raise OSError(e, f"cannot install the SIGBUS handler: {strerror(e).decode()}")
        b.guard_slot = fc_guard_claim(<uintptr_t>b.ptr, <uintptr_t>b.ptr + <uintptr_t>b.size,
                                      PROT_READ | (PROT_WRITE if b.writable else 0))
        # With every slot taken (1,024 mappings read at once) the reads go unguarded, as before.
    b.guards += 1
    return 0


cdef int guard_poll(_Block b, object path, object what) except -1:
    """Raise if a read under the open guards of ``b`` has met a truncated file."""
    cdef uintptr_t fault
    if b.guard_slot >= 0 and b.fault_offset < 0:
        fault = fc_guard_fault(b.guard_slot)
        if fault != 0:
            b.fault_offset = <Py_ssize_t>(fault - <uintptr_t>b.ptr)
    if b.fault_offset >= 0:
        _raise_truncated(path, b, what)
    return 0


cdef int guard_exit(_Block b, object path, object what) except -1:
    """Close a guard that :func:`guard_enter` opened; raises if a read under it met a truncated file."""
    cdef uintptr_t fault = 0
    if not b.is_mmap or b.ptr == NULL:
        return 0
    b.guards -= 1
    if b.guard_slot >= 0:
        fault = fc_guard_release(b.guard_slot) if b.guards == 0 else fc_guard_fault(b.guard_slot)
        if b.guards == 0:
            b.guard_slot = -1
    if fault != 0 and b.fault_offset < 0:
        b.fault_offset = <Py_ssize_t>(fault - <uintptr_t>b.ptr)
    if b.fault_offset >= 0:
        _raise_truncated(path, b, what)
    return 0


cdef class _Guard:
    """What :meth:`MappedFile.guard` returns: a context manager over one mapping (a no-op without one)."""

    cdef _Block _block
    cdef object _path
    cdef object _what
    cdef bint _entered

    def __enter__(self):
        if self._block is not None:
            guard_enter(self._block, self._path, self._what, True)
            self._entered = True
        return self

    def check(self):
        """Raise now if a read under this guard has met a truncated file (work that must not finish on zeros,
        a write about to commit, polls it)."""
        if self._block is not None:
            guard_poll(self._block, self._path, self._what)

    def __exit__(self, exc_type, exc, tb):
        cdef _Block b = self._block
        if self._entered:
            self._entered = False
            if (isinstance(exc, OSError) and exc.errno == EFAULT and b.fault_offset < 0
                    and _size_now(self._path) < b.size):
                # A system call handed the mapping (writev of its views) met the truncation: the kernel says
                # EFAULT instead of sending SIGBUS. The same FormatError, and the mapping remembers it.
                b.fault_offset = _size_now(self._path)
            guard_exit(b, self._path, self._what)
        return False


cdef Py_ssize_t _size_now(object path):
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


cdef int _raise_truncated(object path, _Block block, object what) except -1:
    try:
        now = f"now has {os.stat(path).st_size} bytes"
    except OSError as e:
        now = f"is gone ({e.strerror})"
    raise FormatError(
        f"{path}: the file was truncated or replaced while reading {what} (or its storage failed): byte "
        f"{block.fault_offset} of its {block.size}-byte mapping is no longer in the file, which {now}. Open it "
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
        self._check(offset, length, what)
        if self._block is not None:
            if not length:
                return b""
            block = self._block
            guard_enter(block, self.path, what)  # within a parse's guard: a counter, no system call
            try:
                return (<const char*>block.ptr)[offset:offset + length]
            finally:
                guard_exit(block, self.path, what)
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
        conversions) runs under it, in whichever thread makes the copy: a page that is no longer in the file
        reads as zeros and, on leaving the block, :class:`~fastckpt.errors.FormatError` names the file and
        says it was "truncated or replaced while reading" ``what``. The mapping remembers it: every later
        guard over it raises at once (its pages from the first missing one on now read as zeros, so no later
        read of the mapping can be trusted). Views handed out stay plain
        mapped memory: reading one outside a guard after the file shrank is SIGBUS, as for any mapping
        (``backend="pread"`` makes copies instead). A no-op for the pread and memory backends. Guards nest
        and may be held by several threads at once.

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
