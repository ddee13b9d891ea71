"""The output folder of a run: checked before any work, and held by one run at a time.

A folder that cannot be written is found out in the first second, not after minutes of
profiling; two tunes pointed at the same folder would interleave their study, profile and
policy, so the second is refused with one line while the first holds the folder's lock.

A run writes only into a folder that is autoprec's: new or empty, marked by an earlier run
(:data:`MARKER_NAME`, written when a run claims the folder), or left by an autoprec from before
the marker, which holds nothing but names autoprec writes and at least one of its state files.
A folder with anything else in it is the user's, and its files (a ``report.md`` of their own)
are never replaced.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MARKER_NAME", "OutDirError", "claim_out_dir"]

LOCK_NAME = ".autoprec.lock"
MARKER_NAME = ".autoprec-outputs"
# What autoprec writes into its folder: an unmarked folder holding only these (and at least one of
# _STATE) is an older autoprec's, so resuming it keeps working.
_OUTPUTS = {LOCK_NAME, "policy.json", "report.md", "pareto.png", "loss.png", "sensitivity.png", "profile.json",
            "profile.json.tmp", "study.db", "study.db-journal", "study.db-wal", "study.db-shm"}
_STATE = {LOCK_NAME, "profile.json", "study.db", "policy.json"}


class OutDirError(ValueError):
    """The output folder cannot be used; the message says why and what to do."""


@contextlib.contextmanager
def claim_out_dir(path: str | Path) -> Iterator[Path]:
    """Create ``path`` if needed, check it is a writable folder, and hold its lock while the run lasts."""
    import fcntl

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutDirError(f"output folder {str(path)!r} is a file; give a folder (--out DIR)")
    _check_ours(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / MARKER_NAME).touch()
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


def _check_ours(path: Path) -> None:
    """Refuse a folder that holds the user's own files (see the module's docstring)."""
    try:
        names = {entry.name for entry in path.iterdir()} if path.is_dir() else set()
    except OSError:
        return  # unreadable: creating the lock says why, in one line
    if not names or MARKER_NAME in names or (names <= _OUTPUTS and names & _STATE):
        return
    theirs = sorted(names - _OUTPUTS) or sorted(names)
    shown = ", ".join(theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
    raise OutDirError(f"output folder {str(path)!r} already holds files that autoprec did not write ({shown}); "
                      "give a new or empty folder (--out DIR) so that nothing of yours is replaced")
