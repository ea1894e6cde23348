"""The torch.distributed rendezvous (model_setup.rendezvous): across nodes, rank 0's TCPStore
listens on the address Ray reported for its node and nowhere else; on one node the worker
group's private ``file://`` store is used as it is (no listener at all).

127.0.0.2 stands in for a node address: it is a loopback address distinct from 127.0.0.1,
so a store bound to every interface (torch's own ``tcp://`` store) answers on 127.0.0.1 too,
and one bound to the node address does not."""

from __future__ import annotations

import multiprocessing
import socket

from tempering.models.policy.model_setup import rendezvous

NODE = "127.0.0.2"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_port() -> tuple[int, socket.socket]:
    """A port free on NODE, and a socket holding the same port on 127.0.0.1, bound and not
    listening, for the test's length: no other process's listener can take 127.0.0.1:port
    (one did, CI 2026-12-03: the other pytest process's server drew that port number, and
    127.0.0.1 answered), so 127.0.0.1 answering can only mean the store listens there -- and
    a store bound to every interface would fail to bind beside the held port (EADDRINUSE:
    the guard has no SO_REUSEADDR). Close it when done."""
    while True:
        port = _free_port(NODE)
        guard = socket.socket()
        try:
            guard.bind(("127.0.0.1", port))
            return port, guard
        except OSError:  # taken on loopback: another port
            guard.close()


def _answers(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


def test_file_rendezvous_on_one_node_is_passed_on():
    assert rendezvous("file:///tmp/x/store", 0, 2) == {"init_method": "file:///tmp/x/store"}


def test_tcp_store_listens_on_the_node_address_only():
    port, guard = _node_port()
    server = rendezvous(f"tcp://{NODE}:{port}", 0, 2)["store"]
    client = rendezvous(f"tcp://{NODE}:{port}", 1, 2)["store"]
    server.set("who", "rank0")
    assert client.get("who") == b"rank0"
    assert _answers(NODE, port)
    assert not _answers("127.0.0.1", port)  # not every interface
    guard.close()


def _rank(rank: int, port: int, out: multiprocessing.Queue) -> None:
    import os

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                       "TEMPERING_DIST_INIT_METHOD": f"tcp://{NODE}:{port}",
                       "GLOO_SOCKET_IFNAME": "lo"})  # fmt: skip
    from tempering.models.policy.model_setup import init_topology

    topology = init_topology(tp_size=1)
    total = topology.all_reduce([rank + 1.0])[0]
    elsewhere = _answers("127.0.0.1", port) if rank == 0 else None
    topology.all_reduce([0.0])  # rank 0 probed while the store was up
    out.put((rank, total, elsewhere))


def test_two_ranks_form_a_group_through_the_node_address():
    port, guard = _node_port()
    ctx = multiprocessing.get_context("fork")  # torch is imported already: no re-import
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (total, elsewhere)) for r, total, elsewhere in
                   (out.get(timeout=240) for _ in procs))  # fmt: skip
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    guard.close()
    assert results == {0: (3.0, False), 1: (3.0, None)}


def _lone(out: multiprocessing.Queue) -> None:
    import os

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TEMPERING_DIST_INIT_METHOD"):
        os.environ.pop(name, None)
    from tempering.models.policy.model_setup import _init_method, init_topology

    method = _init_method(1)
    out.put((method.startswith("tcp://127.0.0.1:"), init_topology(tp_size=1).world_size))


def test_a_lone_rank_rendezvous_stays_on_loopback():
    """A policy worker built outside a worker group (tests, notebooks): a loopback store."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_lone, args=(out,))
    proc.start()
    assert out.get(timeout=120) == (True, 1)
    proc.join(60)
    assert proc.exitcode == 0
