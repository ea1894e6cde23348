"""Test certificates made on the spot with `cryptography` (no files committed, no openssl CLI).

`self_signed(dir)`: one self-signed server certificate (what a user makes with
``openssl req -x509``); `ca_and_node(dir)`: a CA and a certificate it signed, as Ray's TLS wants
(each process presents the node certificate and trusts the CA). Both name localhost, 127.0.0.1
and any `ips` given in their subjectAltName."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: str, key, ips: tuple[str, ...], ca: bool):
    now = datetime.datetime.now(datetime.UTC)
    san = [x509.DNSName("localhost")]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", *ips)]
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
    )


def _write(path: Path, cert=None, key=None) -> str:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return str(path)


def self_signed(out: Path, ips: tuple[str, ...] = ()) -> tuple[str, str]:
    """(certfile, keyfile) of a self-signed certificate for localhost/127.0.0.1."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _builder("tempering test server", "tempering test server", key, ips, ca=True)
    cert = cert.sign(key, hashes.SHA256())
    return _write(out / "server.crt", cert=cert), _write(out / "server.key", key=key)


def ca_and_node(out: Path, ips: tuple[str, ...] = ()) -> tuple[str, str, str]:
    """(ca_cert, node_cert, node_key): a CA and a node certificate signed by it."""
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _builder("tempering test CA", "tempering test CA", ca_key, (), ca=True)
    ca = ca.sign(ca_key, hashes.SHA256())
    key = ec.generate_private_key(ec.SECP256R1())
    node = _builder("tempering test node", "tempering test CA", key, ips, ca=False)
    node = node.sign(ca_key, hashes.SHA256())
    return (_write(out / "ca.crt", cert=ca), _write(out / "node.crt", cert=node),
            _write(out / "node.key", key=key))  # fmt: skip
