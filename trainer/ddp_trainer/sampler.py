"""A DistributedSampler that can start in the middle of an epoch.

Exact resume needs the data order of the interrupted epoch minus the batches already consumed.
``DistributedSampler`` already derives the order from ``(seed, epoch)``; this subclass only adds a start
offset, so skipping costs nothing (no batches are loaded and thrown away).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` plus :meth:`set_start`; :meth:`set_epoch` resets the start to 0."""

    _start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._start = 0

    def set_start(self, index: int) -> None:
        """Skip the first ``index`` samples of this rank's share of the current epoch."""
        if index < 0 or index > self.num_samples:
            raise ValueError(f"start {index} outside [0, {self.num_samples}]")
        self._start = index

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self._start :])

    def __len__(self) -> int:
        return self.num_samples - self._start
