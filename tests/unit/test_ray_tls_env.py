"""init_ray's check of Ray's TLS variables (virtual_cluster.check_ray_tls_env), before Ray
starts: a missing variable, a certificate/key mismatch or a certificate the CA did not sign is
an error naming the variable and the path, not a gRPC failure or a hang later. The cluster
itself over TLS: tests/functional/test_ray_tls.py (slow)."""

from __future__ import annotations

import pytest

from tempering.distributed.virtual_cluster import check_ray_tls_env
from tests.tls_certs import ca_and_node, self_signed


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ca, cert, key = ca_and_node(tmp_path_factory.mktemp("ray-tls"))
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": cert, "RAY_TLS_SERVER_KEY": key,
            "RAY_TLS_CA_CERT": ca}  # fmt: skip


def test_a_good_set_passes_and_tls_off_checks_nothing(env):
    assert check_ray_tls_env(env) is True
    assert check_ray_tls_env({**env, "RAY_USE_TLS": "0", "RAY_TLS_CA_CERT": "/nope"}) is False


def test_bad_sets_are_named(env, tmp_path):
    other_cert, other_key = self_signed(tmp_path)
    cases = [
        ({"RAY_TLS_CA_CERT": ""}, "RAY_TLS_CA_CERT unset"),
        ({"RAY_TLS_SERVER_KEY": str(tmp_path / "gone.key")},
         f"RAY_TLS_SERVER_KEY='{tmp_path / 'gone.key'}' does not exist"),
        ({"RAY_TLS_SERVER_KEY": other_key}, "do not load as a certificate and its key"),
        ({"RAY_TLS_CA_CERT": other_cert}, f"does not verify against RAY_TLS_CA_CERT='{other_cert}'"),
        ({"RAY_TLS_CA_CERT": env["RAY_TLS_SERVER_KEY"]}, "the CA file does not load as PEM"),
    ]  # fmt: skip
    for change, message in cases:
        with pytest.raises(ValueError) as info:
            check_ray_tls_env({**env, **change})
        assert message in str(info.value), (change, str(info.value))
