"""What a streamed profile saves in the run folder's ``stream/`` as it goes, so an interrupted tune resumes where it
stopped: ``figures.json`` (the fingerprint of the checkpoint, batches and settings; the output head's figures; the
probe's verdict; each finished block's figures), ``cotangents-{i}.pt`` (the cotangents at block ``i``'s input, the
output head's at ``cotangents-{blocks}.pt``) and, where torchrun ranks share the blocks, ``block-{i}.json`` (block
``i``'s figures, written by the rank that measured it, until the first rank merges them into ``figures.json``).

A folder of another checkpoint, batches or settings starts again: its cotangents and block files are removed. Every
file is written whole or not at all (to a temporary name, then renamed), so an interrupt leaves the last complete one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["Saved"]


class Saved:
    """The saved state of one streamed profile in ``folder``, resumed where it matches ``fingerprint``."""

    def __init__(self, folder: Path, fingerprint: str) -> None:
        self.folder, self.file, self.fingerprint = folder, folder / "figures.json", fingerprint
        folder.mkdir(parents=True, exist_ok=True)
        data = json.loads(self.file.read_text()) if self.file.is_file() else {}
        if data.get("fingerprint") == fingerprint:
            self.data = data
        else:  # another run's, or none: what it left is not this run's
            self.data = {"fingerprint": fingerprint, "blocks": {}}
            for old in [*folder.glob("cotangents-*.pt"), *folder.glob("block-*.json")]:
                old.unlink()
        for path in folder.glob("block-*.json"):  # blocks the ranks of a torchrun job measured
            saved = json.loads(path.read_text())
            if saved.get("fingerprint") == fingerprint:
                self.data["blocks"][path.stem.removeprefix("block-")] = saved["figures"]

    @staticmethod
    def written(folder: Path, fingerprint: str) -> bool:
        """Whether ``folder`` holds the figures of the run ``fingerprint`` names (what another rank wrote there)."""
        try:
            return json.loads((folder / "figures.json").read_text()).get("fingerprint") == fingerprint
        except (OSError, ValueError):
            return False

    def done(self) -> set[int]:
        """The blocks whose figures are saved."""
        return {int(i) for i in self.data["blocks"]}

    def has_cotangents(self, index: int) -> bool:
        return self._cotangents_file(index).is_file()

    def lowest_done(self, blocks: int) -> int:
        """Where a profile that goes down the blocks one by one (measuring each, carrying the cotangents below it)
        resumes: the lowest block from which every block up is done and the cotangents at its input are saved; 0
        where every block is done (nothing to carry); ``blocks`` where none is."""
        low = blocks
        while low > 0 and low - 1 in self.done():
            low -= 1
        if low == 0:
            return 0
        return next((i for i in range(low, blocks) if self.has_cotangents(i)), blocks)

    def save(self, key: str, figures: dict, index: int, cotangents: list[torch.Tensor], keep: bool = False) -> None:
        """The figures of block ``key`` (or of ``"head"``) and the cotangents at its input (``index``); the
        cotangents saved before are removed (unless ``keep``: the ranks of a torchrun job read them all)."""
        self.save_cotangents(index, cotangents, keep)
        if key == "head":
            self.data["head"] = figures
        else:
            self.data["blocks"][key] = figures
        self.write()

    def save_cotangents(self, index: int, cotangents: list[torch.Tensor], keep: bool = True) -> None:
        tmp = self.folder / f"cotangents-{index}.tmp"
        torch.save(cotangents, tmp)
        tmp.replace(self._cotangents_file(index))
        if not keep:
            for old in self.folder.glob("cotangents-*.pt"):
                if old.name != f"cotangents-{index}.pt":
                    old.unlink()

    def cotangents(self, index: int) -> list[torch.Tensor]:
        return torch.load(self._cotangents_file(index), weights_only=True)

    def save_block(self, index: int, figures: dict) -> None:
        """Block ``index``'s figures in a file of its own: what a rank writes while the others write theirs."""
        self._whole(self.folder / f"block-{index}.json", {"fingerprint": self.fingerprint, "figures": figures})
        self.data["blocks"][str(index)] = figures

    def merge(self, blocks: int) -> None:
        """Every block's figures into ``figures.json`` (the ranks' block files removed), and the cotangents carried
        for the ranks removed but the output head's: with every block done, none is needed again."""
        self.write()
        for path in self.folder.glob("block-*.json"):
            path.unlink()
        for path in self.folder.glob("cotangents-*.pt"):
            if path.name != f"cotangents-{blocks}.pt":
                path.unlink()

    def keep(self, key: str, value: Any) -> None:
        """A figure of the whole run (the probe's verdict), saved before any block's."""
        self.data[key] = value
        self.write()

    def write(self) -> None:
        self._whole(self.file, self.data)

    def _cotangents_file(self, index: int) -> Path:
        return self.folder / f"cotangents-{index}.pt"

    @staticmethod
    def _whole(path: Path, data: dict) -> None:
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)  # whole or not at all: an interrupt leaves the last complete figures
