"""Weighted blends of datasets: which dataset each of a step's prompts comes from, drawn by
weight with a seeded sampler whose state a checkpoint keeps.

:class:`BlendSampler` draws entry indices from the normalised weights. Its ``n``-th call uses a
generator seeded by ``(seed, n)`` alone (numpy's ``SeedSequence``), so its state is two
integers, ``{"seed", "calls"}``: restored, it continues with exactly the draws the
uninterrupted sampler would have made. :class:`BlendLoader` is GRPO's data loader for a blend
(the interface of `StatefulDataLoader`: ``next_batch``, ``state_dict``, ``load_state_dict``,
``epochs_completed``, ``dataset``): per step it draws each prompt's entry, then takes the
next problem from that entry's own resumable loader (its shuffles are the entry's, one epoch
after another). Its ``state_dict()`` holds the sampler's state and each entry's position,
under the checkpoint's ``dataloader`` key (tempering/algorithms/common.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from tempering.data.dataloader import StatefulDataLoader
from tempering.errors import UserInputError

log = logging.getLogger(__name__)


class BlendError(ValueError, UserInputError):
    """A blend that cannot be drawn from (its message names the key, the value and the fix)."""


def normalised(weights: Sequence[float]) -> list[float]:
    """The weights as shares summing to 1 (each must be positive and finite)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise BlendError(
            f"blend weights {list(weights)} must be one or more positive finite numbers "
            "(data.blend[i].weight; they are normalised to sum to 1)"
        )
    return (w / w.sum()).tolist()


class BlendSampler:
    """Seeded, resumable draws of entry indices by weight (``shares``: normalised weights)."""

    def __init__(self, weights: Sequence[float], seed: int) -> None:
        self.shares = normalised(weights)
        self.seed = int(seed)
        self.calls = 0

    def draw(self, n: int) -> list[int]:
        """``n`` entry indices, each drawn independently with probability its share."""
        rng = np.random.default_rng([self.seed, self.calls])
        self.calls += 1
        return rng.choice(len(self.shares), size=n, p=self.shares).tolist()

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = {"seed", "calls"} - set(state)
        if missing:
            raise KeyError(f"blend sampler state lacks {sorted(missing)}; got {sorted(state)}")
        self.seed, self.calls = int(state["seed"]), int(state["calls"])


class BlendLoader:
    """Each step's ``batch_size`` problems, their entries drawn by weight (`BlendSampler`)."""

    def __init__(
        self,
        entries: dict[str, Sequence[Any]],
        weights: Sequence[float],
        batch_size: int,
        seed: int = 0,
    ) -> None:
        """``entries``: name -> that entry's training examples, in the blend's order."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if len(entries) != len(weights):
            raise ValueError(f"{len(entries)} blend entries but {len(weights)} weights")
        self.names = list(entries)
        for i, (name, items) in enumerate(entries.items()):
            if len(items) == 0:
                raise BlendError(
                    f"data.blend[{i}] ({name!r}) has no training problems: point it at data "
                    "that holds some, raise its num_train_samples, or remove the entry"
                )
        # one loader per entry, each on its own shuffles (entries of one dataset differ)
        self.loaders = {
            name: StatefulDataLoader(items, 1, seed=seed + 7919 * (i + 1))
            for i, (name, items) in enumerate(entries.items())
        }
        self.sampler = BlendSampler(weights, seed)
        self.batch_size = batch_size

    @property
    def shares(self) -> dict[str, float]:
        """Each entry's normalised weight."""
        return dict(zip(self.names, self.sampler.shares, strict=True))

    @property
    def dataset(self) -> list[Any]:
        """Every entry's examples, in the blend's order (for counts in messages)."""
        return [x for loader in self.loaders.values() for x in loader.dataset]

    @property
    def epochs_completed(self) -> int:
        """Whole passes over the blend: the fewest any entry has made (``max_num_epochs=1``
        stops once every entry's data has been drawn at least once)."""
        return min(loader.epochs_completed for loader in self.loaders.values())

    def next_batch(self) -> list[Any]:
        """The step's problems, in draw order."""
        picks = self.sampler.draw(self.batch_size)
        return [self.loaders[self.names[j]].next_batch()[0] for j in picks]

    def state_dict(self) -> dict[str, Any]:
        return {
            "blend": self.sampler.state_dict(),
            "entries": {name: loader.state_dict() for name, loader in self.loaders.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; a checkpoint of other entries (or of a run without a blend)
        is refused by name, since its positions would belong to other data."""
        saved = list(state.get("entries", {}))
        if "blend" not in state or saved != self.names:
            raise BlendError(
                f"the checkpoint's data loader state holds the entries {saved} (none: a run "
                f"without data.blend), and this run's data.blend has {self.names}: resume with "
                "the blend it was saved with, or give this run its own "
                "checkpointing.checkpoint_dir"
            )
        self.sampler.load_state_dict(state["blend"])
        for name, loader in self.loaders.items():
            loader.load_state_dict(state["entries"][name])
