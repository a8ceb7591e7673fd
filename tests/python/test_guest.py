"""attncore is a good guest in the host process (docs/design.md section 8): a call changes no
process-wide state that others read. Here: the thread count of numpy's OpenBLAS, read from
another thread while a long math call runs, and after it (the math backend once set it to 1
for the whole process)."""

import ctypes
import threading

import numpy as np
import pytest

import attncore


def _openblas_thread_counts():
    """The loaded libraries that export OpenBLAS's thread count (numpy's BLAS: Debian's
    libblas.so.3 from OpenBLAS, or a wheel's bundled libopenblas), as (path, get, set)."""
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "blas" in fields[5] and ".so" in fields[5]:
                paths.add(fields[5])
    found = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            get, put = lib.openblas_get_num_threads, lib.openblas_set_num_threads
        except (OSError, AttributeError):
            continue
        get.restype = ctypes.c_int
        put.argtypes = [ctypes.c_int]
        found.append((path, get, put))
    return found


def test_math_call_leaves_the_blas_thread_count_alone():
    np.ones((2, 2)) @ np.ones((2, 2))  # numpy's BLAS is loaded and initialised
    libraries = _openblas_thread_counts()
    if not libraries:
        pytest.skip("numpy's BLAS is not OpenBLAS (no openblas_get_num_threads loaded)")
    # A count other than 1, so that a call setting it to 1 shows (OpenBLAS starts at the CPU
    # count, which may be 1); restored at the end.
    saved = [get() for _, get, _ in libraries]
    for _, _, put in libraries:
        put(3)
    expected = [get() for _, get, _ in libraries]
    assert all(n != 1 for n in expected), expected
    try:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 8, 3072, 64), dtype=np.float32) for _ in range(3))
        seen = set()
        done = threading.Event()

        def call():
            try:
                attncore.attention(q, k, v, backend="math", num_threads=1)
            finally:
                done.set()

        worker = threading.Thread(target=call)
        worker.start()
        reads = 0
        while not done.wait(0.001):  # the call takes a few hundred ms
            seen.add(tuple(get() for _, get, _ in libraries))
            reads += 1
        worker.join()
        after = [get() for _, get, _ in libraries]
        print(f"OpenBLAS thread count ({[p for p, _, _ in libraries]}): before {expected}, "
              f"during {sorted(seen)} ({reads} reads), after {after}")
        assert reads >= 10, "the call ended too soon to be observed"
        assert seen == {tuple(expected)}
        assert after == expected
    finally:
        for (_, _, put), n in zip(libraries, saved):
            put(n)
