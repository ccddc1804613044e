"""The stateful prompt loader: its `state_dict()` is the whole data position (epoch, place in the epoch).

The order of epoch e is a permutation seeded from (seed, e), so the shuffle needs no generator
state beyond the epoch number; the sampler counts what it has handed out, and torchdata's
StatefulDataLoader stores that count with the rest of its state.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from rlrunner.utils.seeding import derive_seed


class EpochShuffleSampler(Sampler[int]):
    """Indices of one epoch per `iter()`; each exhausted iteration moves on to the next epoch."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # indices of the current epoch already handed out

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "epoch", epoch))
        return torch.randperm(self.size, generator=generator).tolist()

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        while self.position < self.size:
            self.position += 1
            yield order[self.position - 1]
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_compatible(state)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    def check_compatible(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError(
                f"data position was saved for a dataset of {state['size']} prompts with seed {state['seed']}, "
                f"this run has {self.size} prompts with seed {self.seed}"
            )


def _keep_records(batch: list[dict]) -> list[dict]:
    return batch


class PromptLoader:
    """Endless batches of prompt records, epoch after epoch, resumable mid-epoch."""

    def __init__(self, dataset, batch_size: int, seed: int, shuffle: bool = True):
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.sampler = EpochShuffleSampler(len(dataset), seed, shuffle)
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=True,
            collate_fn=_keep_records,
            num_workers=0,
        )
        self._iterator: Iterator[list[dict]] | None = None

    @property
    def epoch(self) -> int:
        """The epoch (0-based) of the batch `next_batch` returned last."""
        return self.sampler.epoch

    @property
    def steps_per_epoch(self) -> int:
        return len(self.loader)

    def next_batch(self) -> list[dict]:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        try:
            return next(self._iterator)
        except StopIteration:
            # The epoch is over (its leftover prompts, fewer than a batch, are dropped): start the next one.
            self._iterator = iter(self.loader)
            return next(self._iterator)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # StatefulDataLoader applies the sampler's part lazily; check it now so a mismatch fails at load.
        self.sampler.check_compatible(state["_sampler_iter_state"]["sampler_state"])
        self.loader.load_state_dict(state)
        self._iterator = None
