"""Environments as Ray actors: the actor class around an environment, and what crosses Ray.

`actor_class(cls)` is the class `registry.create_environment_actor` starts: the environment
with the reliability tests' fault hook before ``step``, a ``resource_usage`` report, and
tensors crossing as numpy both ways (`to_wire`, `from_wire`), so that the environment sees
tensors as it does in process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def actor_class(cls: type) -> type:
    """``cls`` as an actor class: its ``step`` first passes the reliability tests' fault hook
    (``faults.py``), and ``resource_usage`` reports the actor's process (``resources.py``).
    Tensors cross as numpy both ways (`to_wire`): ``step`` returns its rewards so, and
    ``global_post_process_and_metrics`` turns a batch sent so back into tensors, so the
    environment itself sees tensors as in process."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        from tempering.utils import faults

        faults.maybe_fault("environment", "environment")
        ret = cls.step(self, *args, **kwargs)
        return ret._replace(rewards=to_wire(ret.rewards), terminateds=to_wire(ret.terminateds))

    def global_post_process_and_metrics(self: Any, batch: Any) -> Any:
        batch = {k: from_wire(v) for k, v in batch.items()}
        return cls.global_post_process_and_metrics(self, batch)

    def resource_usage(self: Any) -> dict[str, float]:
        from tempering.utils.resources import process_usage

        return process_usage()

    methods = {
        "step": step,
        "global_post_process_and_metrics": global_post_process_and_metrics,
        "resource_usage": resource_usage,
        "__module__": cls.__module__,
    }
    return type(cls.__name__, (cls,), methods)


def to_wire(value: Any) -> Any:
    """What to send an environment actor (or return from one) for ``value``: a CPU tensor's
    numpy array (a copy: the sender keeps nothing it sent), else ``value``. numpy crosses Ray's
    pickling in microseconds, a torch tensor through torch.save's zip writer (~0.2 ms each
    way); the receiver turns it back (`route_step`, the actor class's metrics method)."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        try:
            return value.detach().numpy().copy()
        except TypeError:  # a dtype numpy lacks (bfloat16): the tensor itself
            return value
    return value


def from_wire(value: Any) -> Any:
    """A numpy array as a (writable) tensor; else ``value``."""
    return torch.tensor(value) if isinstance(value, np.ndarray) else value
