"""Whether a tune fits the machine: memory the kernel gives back on demand counts as free."""

from __future__ import annotations

import torch

from autoprec.inputs import fits

MEMINFO = """MemTotal:       24576000 kB
MemFree:          600000 kB
MemAvailable:   23000000 kB
Buffers:           10000 kB
Cached:         20000000 kB
"""


def test_page_cache_counts_as_free(tmp_path, monkeypatch):
    """A machine that has just written gigabytes of checkpoints has little MemFree and much MemAvailable: a 0.8 GiB
    model fits (it was refused with '0.6 GiB is free' after benchmarks/serving.py wrote its checkpoints)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    monkeypatch.setattr(fits, "MEMINFO", str(meminfo))
    assert fits._free_bytes(torch.device("cpu")) == 23000000 * 1024
    with torch.device("meta"):  # counted, not allocated
        model = torch.nn.Linear(14336, 14336)  # 0.77 GiB in fp32: more than MemFree, far less than MemAvailable
    fits.check_fits(model, torch.zeros(2, 14336), torch.device("cpu"))


def test_without_meminfo_free_pages_are_read(tmp_path, monkeypatch):
    monkeypatch.setattr(fits, "MEMINFO", str(tmp_path / "missing"))
    assert fits._free_bytes(torch.device("cpu")) is not None  # SC_AVPHYS_PAGES on any POSIX system
