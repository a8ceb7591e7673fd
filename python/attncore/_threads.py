"""attncore.set_num_threads / get_num_threads: the process-wide thread count of calls that pass
no num_threads (docs/design.md section 8: a call's num_threads, else this setting, else the
environment variable ATTNCORE_NUM_THREADS, else the CPUs the process may run on)."""

from . import _core
from ._rank4 import int_option


def set_num_threads(num_threads):
    """Sets how many threads attncore's calls use when they pass no num_threads, for the whole
    process (every thread; calls already running keep their count). 1 to 1024; 0 clears the
    setting, so that ATTNCORE_NUM_THREADS and then the CPUs this process may run on decide
    again. Changes nothing outside attncore (torch's and BLAS's thread counts stay as they
    are). TypeError for a non-integer, ValueError outside 0..1024 (the setting is kept)."""
    _core.set_num_threads(int_option("set_num_threads", "num_threads", num_threads,
                                     -2 ** 31, 2 ** 31 - 1))


def get_num_threads():
    """The number of threads a call made now without num_threads would use: the count
    set_num_threads set, else ATTNCORE_NUM_THREADS, else the CPUs this process may run on.
    ValueError when ATTNCORE_NUM_THREADS holds anything but an integer from 1 to 1024."""
    return _core.get_num_threads()
