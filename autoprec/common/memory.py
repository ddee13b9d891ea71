"""Memory a process gives back: what a streamed run frees a block at a time."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

__all__ = ["return_freed_memory"]


def return_freed_memory() -> None:
    """Give the pages of freed tensors back to the system (glibc's ``malloc_trim``; nothing elsewhere). glibc keeps
    freed memory in its heap, so without this the resident
    memory of a streamed run grows block by block with nothing held: on a 1024-wide 16-block Llama a streamed tune
    went from 0.48 to 1.18 GiB; with the heap trimmed after each block it stayed at 0.45-0.49 GiB (a run cut after
    3 of its 16 sensitivity blocks), as it did with glibc's dynamic mmap threshold turned off."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)
