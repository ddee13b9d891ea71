"""Reading a Linux /proc file: what the machine has free, what runs on it now, which CPU it is."""

from __future__ import annotations

__all__ = ["CPU_FEATURES", "cpu_words", "proc_number"]

# /proc/cpuinfo flags that decide whether a low precision can be fast on a CPU, as Intel and AMD write them
CPU_FEATURES = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512_fp16", "AVX512-FP16"),
                ("avx512f", "AVX512F"), ("avx2", "AVX2"))


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


def cpu_words(path: str = "/proc/cpuinfo") -> str | None:
    """The CPU by its model and the features that matter here, from ``path``: "Intel(R) Xeon(R) Platinum 8480+
    with AMX-BF16, AVX512-BF16, AVX512-FP16, AVX512F, AVX2", "AMD EPYC with AVX2, no bf16 instructions"; None
    where the file has no model name (not Linux, or a CPU that names none)."""
    model, flags = None, set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if model is not None and flags:
                    break
    except OSError:
        return None
    if not model:
        return None
    has = [name for flag, name in CPU_FEATURES if flag in flags]
    if not flags & {"amx_bf16", "avx512_bf16"}:
        has.append("no bf16 instructions")
    return f"{model} with {', '.join(has)}"
