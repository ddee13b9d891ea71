"""The output folder of a run: checked before any work, and held by one run at a time.

A folder that cannot be written is found out in the first second, not after minutes of
profiling; two tunes pointed at the same folder would interleave their study, profile and
policy, so the second is refused with one line while the first holds the folder's lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["OutDirError", "claim_out_dir"]

LOCK_NAME = ".autoprec.lock"


class OutDirError(ValueError):
    """The output folder cannot be used; the message says why and what to do."""


@contextlib.contextmanager
def claim_out_dir(path: str | Path) -> Iterator[Path]:
    """Create ``path`` if needed, check it is a writable folder, and hold its lock while the run lasts."""
    import fcntl

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutDirError(f"output folder {str(path)!r} is a file; give a folder (--out DIR)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle = open(path / LOCK_NAME, "a+")  # noqa: SIM115 -- held open for the whole run
    except OSError as e:
        raise OutDirError(f"cannot write into output folder {str(path)!r}: {e.strerror or e}; "
                          "give a folder you can write to (--out DIR)") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            raise OutDirError(f"output folder {str(path)!r} is in use by another autoprec run ({owner}); "
                              "wait for it to finish or give another folder (--out DIR)") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield path
    finally:
        handle.close()  # releases the lock
