"""The CPU forward's threads, which Python's main thread joins."""

from __future__ import annotations

import threading

from . import _core

_adopted = False


def adopt_main_thread() -> None:
    """Makes Python's main thread one of the CPU forward's ``MOEQ_NUM_THREADS`` threads (once;
    on any other thread, nothing). Its forwards then start at once instead of waking a sleeping
    worker first (~0.1 ms), and the parallel work it starts in Rust (opening a checkpoint,
    packing a layer) runs on those threads rather than on a pool of its own that would then
    sit idle. Only the main thread: it lives as long as the process."""
    global _adopted
    if not _adopted and threading.current_thread() is threading.main_thread():
        _adopted = True
        _core.cpu_adopt_calling_thread()
