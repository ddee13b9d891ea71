"""Reading one number from a Linux /proc file: what the machine has free, what runs on it now."""

from __future__ import annotations

__all__ = ["proc_number"]


def proc_number(path: str, key: str) -> int | None:
    """The first number after ``key`` on the line of ``path`` that starts with it (``proc_number("/proc/meminfo",
    "MemAvailable:")``, in the file's own unit); None where the file or the line is missing or unreadable (not
    Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line[len(key):].split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return None
