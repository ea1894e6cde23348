"""Ray with its own TLS on (slow tier): ``RAY_USE_TLS=1`` plus ``RAY_TLS_SERVER_CERT``,
``RAY_TLS_SERVER_KEY`` and ``RAY_TLS_CA_CERT`` (docs/cluster.md).

A CA and a node certificate are made in the test (tests/tls_certs.py); a subprocess -- Ray
reads the variables when it starts -- runs tempering's `init_ray` (which checks the files
first), a remote task and an actor, prints the GCS address and holds the cluster up while
this test probes that port: a client that does not trust the CA fails the handshake, one that
trusts it but presents no certificate (mutual TLS) and a plaintext one get no HTTP/2 answer,
and only one with the CA and a signed certificate gets the server's SETTINGS frame."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tls_certs import ca_and_node

REPO = Path(__file__).resolve().parents[2]
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS = 0x04  # an HTTP/2 frame's type byte (offset 3)

DRIVER = """
import json, sys
import ray
from tempering.distributed.virtual_cluster import init_ray
init_ray(num_cpus=2, temp_dir=sys.argv[1])

@ray.remote
def double(x):
    return 2 * x

@ray.remote
class Counter:
    def __init__(self):
        self.n = 0
    def add(self):
        self.n += 1
        return self.n

counter = Counter.remote()
ray.get(counter.add.remote())
print(json.dumps({"task": ray.get(double.remote(21)), "actor": ray.get(counter.add.remote()),
                  "gcs": ray.get_runtime_context().gcs_address}), flush=True)
sys.stdin.readline()  # the test probes the GCS port meanwhile
ray.shutdown()
"""


def _h2_answer(host: str, port: int, context: ssl.SSLContext | None) -> bytes:
    """What the GCS sends back to an HTTP/2 client preface (b"" when it hangs up)."""
    with socket.create_connection((host, port), timeout=10) as raw:
        sock = context.wrap_socket(raw, server_hostname=host) if context else raw
        with sock:
            sock.sendall(H2_PREFACE)
            try:
                return sock.recv(64)
            except (ConnectionError, ssl.SSLError):
                return b""


@pytest.mark.slow
@pytest.mark.timeout(420)  # ~40 s idle; 224 s seen on 2 cores at load 11
def test_a_ray_cluster_over_tls_runs_tasks_and_refuses_strangers(tmp_path):
    import ray

    ca, cert, key = ca_and_node(tmp_path / "certs", ips=(ray.util.get_node_ip_address(),))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": cert, "RAY_TLS_SERVER_KEY": key,
                "RAY_TLS_CA_CERT": ca, "PYTHONPATH": str(REPO)})  # fmt: skip
    ray_tmp = Path("/tmp") / f"rt{os.getpid()}"  # Ray's socket paths must stay short
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(ray_tmp)], env=env, cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line, f"the TLS driver died (exit {proc.wait(30)}); its stderr is above"
        report = json.loads(line)
        assert (report["task"], report["actor"]) == (42, 2)
        host, port = report["gcs"].rsplit(":", 1)
        port = int(port)

        member = ssl.create_default_context(cafile=ca)
        member.load_cert_chain(cert, key)
        member.set_alpn_protocols(["h2"])
        answer = _h2_answer(host, port, member)
        assert len(answer) >= 9 and answer[3] == SETTINGS, answer

        with pytest.raises(ssl.SSLCertVerificationError):  # does not trust the CA
            _h2_answer(host, port, ssl.create_default_context())
        no_client_cert = ssl.create_default_context(cafile=ca)
        no_client_cert.set_alpn_protocols(["h2"])
        assert _h2_answer(host, port, no_client_cert) == b""
        assert _h2_answer(host, port, None) == b""  # plaintext gRPC
    finally:
        proc.stdin.close()
        proc.wait(120)
