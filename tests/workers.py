"""Small worker classes that the distributed-core tests and benchmark build by name.

They are not part of the package: tests/conftest.py (and bench/bench_worker_group.py, for
EchoWorker) enter them in ``ACTOR_ENVIRONMENT_REGISTRY`` by name. None is imported
by the driver when a worker group builds it: the FQN travels, and the class is imported inside
the worker (the checkout's root is on every worker venv's path).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


class EchoWorker:
    """Reports who and where it is; echoes and sums what it is sent."""

    def __init__(self, tag: str = "echo") -> None:
        self.tag = tag

    def whoami(self) -> dict[str, Any]:
        import ray

        env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
        return {
            "tag": self.tag,
            **{k.lower(): os.environ.get(k) for k in env},
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "python": sys.executable,
        }

    def echo(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"rank": int(os.environ["RANK"]), "args": args, "kwargs": kwargs}

    def shard_summary(self, data: dict, scale: int = 1) -> dict[str, Any]:
        """The rank, the ``ids`` it received (as a list) and their scaled sum."""
        ids = data["ids"].tolist()
        return {"rank": int(os.environ["RANK"]), "ids": ids, "sum": scale * sum(ids)}

    def noop(self) -> None:
        return None

    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class WeightSinkWorker:
    """A generation worker's refit side only: records each `update_weights` call (a bucket)."""

    def __init__(self) -> None:
        self.buckets: list[dict[str, Any]] = []

    def update_weights(self, weights: dict[str, Any]) -> None:
        self.buckets.append({name: t.clone() for name, t in weights.items()})

    def received(self) -> list[dict[str, Any]]:
        """The buckets received since the last call."""
        buckets, self.buckets = self.buckets, []
        return buckets


class AllReduceWorker:
    """Joins a gloo process group the way the policy workers do (RANK, WORLD_SIZE and the
    group's TEMPERING_DIST_INIT_METHOD) and all-reduces a tensor; remembers which TCP
    listeners joining opened in this process."""

    def __init__(self) -> None:
        import torch.distributed as dist

        before = _tcp_listeners()
        dist.init_process_group(
            "gloo",
            init_method=os.environ["TEMPERING_DIST_INIT_METHOD"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
        dist.barrier()  # every pair connected: their listeners exist now
        self._opened = sorted(_tcp_listeners() - before)

    def listeners_opened(self) -> list[str]:
        """``ip:port`` of each TCP listener the process group opened here."""
        return self._opened

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sum ``values`` (scaled by rank + 1) over all ranks."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64) * (dist.get_rank() + 1)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class CowsayWorker:
    """Imports ``cowsay``, which only the ``isolation-probe`` extra's venv has."""

    def __init__(self) -> None:
        import cowsay

        self._cowsay = cowsay

    def say(self, text: str) -> dict[str, str]:
        return {
            "said": self._cowsay.get_output_string("cow", text),
            "python": sys.executable,
            "cowsay_file": self._cowsay.__file__,
        }


class RaisingWorker:
    """Raises from a method, or from its constructor when asked."""

    def __init__(self, fail_in_init: bool = False) -> None:
        if fail_in_init:
            raise RuntimeError("RaisingWorker was told to fail in __init__")

    def boom(self, message: str = "boom") -> None:
        raise ValueError(f"rank {os.environ['RANK']}: {message}")

    def ok(self) -> int:
        return int(os.environ["RANK"])


class HangInInitWorker:
    """Never finishes starting (a stuck import or model load). For the start-up deadline."""

    def __init__(self) -> None:
        _sleep_forever()


class DyingWorker:
    """Exits its process without a Python exception (like a kill or an OOM)."""

    def die(self, only_rank: int | None = None, last_words: str = "") -> int:
        rank = int(os.environ["RANK"])
        if only_rank is None or rank == only_rank:
            if last_words:
                os.write(2, f"{last_words}\n".encode())
            os._exit(1)
        return rank

    def segfault(self) -> None:
        """A crash in native code (what a bad kernel or a gloo abort looks like)."""
        import faulthandler

        faulthandler._sigsegv()

    def wait_for_peer(self) -> int:
        """Block in a gloo barrier that never completes if a peer is dead."""
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                init_method=os.environ["TEMPERING_DIST_INIT_METHOD"],
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
            )
        dist.barrier()
        return int(os.environ["RANK"])

    def train_hang(self, sleeping_rank: int = 1) -> int:
        """Never returns: rank ``sleeping_rank`` sleeps in Python, the others wait for it in a
        gloo barrier (a hang inside a collective). For the deadline tests."""
        if int(os.environ["RANK"]) == sleeping_rank:
            _sleep_forever()
        return self.wait_for_peer()


def _sleep_forever() -> None:
    while True:
        time.sleep(0.1)


def _tcp_listeners() -> set[str]:
    """``ip:port`` of the listening TCP sockets this process holds (from /proc, IPv4/IPv6)."""
    import socket

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (
        ("/proc/self/net/tcp", socket.AF_INET),
        ("/proc/self/net/tcp6", socket.AF_INET6),
    ):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            if family == socket.AF_INET:
                raw = raw[::-1]
            else:  # four little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
            found.add(f"{socket.inet_ntop(family, raw)}:{int(hex_port, 16)}")
    return found


class PlacementProbeWorker:
    """Stands in for a generation engine where only its placement is under test: reports
    the GPUs Ray gave it and the CUDA_VISIBLE_DEVICES it runs with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def placement(self) -> dict[str, Any]:
        import ray

        from tempering.distributed.worker_groups import bundle_of_this_actor

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "bundle": bundle_of_this_actor(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
