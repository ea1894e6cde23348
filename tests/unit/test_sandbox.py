"""The math verifier's sandbox, attacked (issue 27): a confined worker reads no files beyond
Python's own, has no environment, cannot unhook its audit hook, and nothing it sends on its
channel is unpickled or trusted by the parent.

The hostile code runs inside the real confined worker through a test-only verify function:
``RUN <code>`` executes ``<code>`` where math-verify would evaluate model text (no escape
through math-verify's own parser is known, which is the point of the sandbox; this is what
one would run). Its answer is ``repr(result)``.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import socket
import struct
import sys
import sysconfig

import pytest

from tempering.environments.math import (
    MAX_REPLY_BYTES,
    VerifierPool,
    VerifyOutcome,
    _parse_reply,
)
from tempering.environments.sandbox import FrameReader, ProtocolViolation

TIMEOUT_S = 10.0  # generous: a fresh worker imports parts of sympy on its first sample

PAYLOAD_VERIFY_SOURCE = """
from tempering.environments.math import math_verify_score

def run_payload(response, ground_truth):
    if response.startswith("RUN "):  # stands for model text that reached sympy's eval
        namespace = {}
        exec(response.removeprefix("RUN "), namespace)
        return 0.0, repr(namespace.get("result"))
    return math_verify_score(response, ground_truth)
"""

# Code that finds this worker's channel (a frame walk; a descriptor number is as easy to
# guess) and writes raw bytes to it, as code that escaped into the worker could.
WRITE_TO_CHANNEL = (
    "import os, sys\n"
    "f = sys._getframe()\n"
    "while f.f_code.co_name != '_worker_main':\n"
    "    f = f.f_back\n"
    "os.write(f.f_locals['conn'].fileno(), bytes.fromhex('{hex}'))\n"
)


def frame(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


class _CreatesMarker:
    """Unpickling this creates ``path``: proof that someone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def payload_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("payload_mod")
    (folder / "tempering_test_payload_verify.py").write_text(PAYLOAD_VERIFY_SOURCE)
    sys.path.insert(0, str(folder))
    yield importlib.import_module("tempering_test_payload_verify")
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def pool(payload_module):
    pool = VerifierPool(payload_module.run_payload, num_workers=2, timeout_s=TIMEOUT_S)
    yield pool
    pool.close()


def run(pool: VerifierPool, code: str) -> VerifyOutcome:
    """Run ``code`` in a confined worker, next to an ordinary sample scored as usual."""
    outcome, normal = pool.map([(f"RUN {code}", "0"), ("so \\boxed{1/2}", "0.5")])
    assert normal == VerifyOutcome("ok", 1.0, "\\frac{1}{2}")
    return outcome


def test_confined_worker_reads_python_files_and_nothing_else(pool, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret-file")
    (tmp_path / "link").symlink_to(secret)
    stdlib = sysconfig.get_paths()["stdlib"]
    climb = stdlib + "/.." * stdlib.count("/") + str(secret)  # starts inside, resolves outside
    reads = {
        "/etc/passwd": "open('/etc/passwd').read()",
        "a planted secret": f"open({str(secret)!r}).read()",
        "pathlib": f"__import__('pathlib').Path({str(secret)!r}).read_text()",
        "os.open": f"import os; os.read(os.open({str(secret)!r}, os.O_RDONLY), 99)",
        "a symlink to it": f"open({str(tmp_path / 'link')!r}).read()",
        "a path that climbs out": f"open({climb!r}).read()",
        "a listing": f"import os; os.listdir({str(tmp_path)!r})",
        "the starting environment": "open('/proc/self/environ', 'rb').read()",
        "a directory to open beneath": f"import os; os.open({stdlib!r}, os.O_RDONLY)",
    }
    refusals = pool.num_refusals
    for what, code in reads.items():
        outcome = run(pool, code)
        assert outcome.status == "error", (what, outcome)
        assert "SandboxViolation" in outcome.answer and "s3cret" not in outcome.answer, what
    assert pool.num_refusals == refusals + len(reads)
    # Python's own files stay readable (lazy imports need them), symlinks resolved
    (tmp_path / "to_os").symlink_to(os.__file__)
    outcome = run(pool, f"result = open({str(tmp_path / 'to_os')!r}).read(9)")
    assert outcome.status == "ok" and outcome.answer == repr(open(os.__file__).read(9))
    assert run(pool, "import sympy.physics.units; result = 1").answer == "1"


@pytest.mark.timeout(120)
def test_confined_worker_has_no_environment_and_no_command_line(payload_module, monkeypatch):
    """A secret in the parent's environment (an API key, HF_TOKEN) is not in the worker.
    ``spawn``: a fresh worker sees the environment as it is now (the fork server keeps the one
    it started with), and the unconfined control proves the secret does reach a worker."""
    monkeypatch.setenv("TEMPERING_TEST_SECRET", "s3cret-env")
    monkeypatch.setenv("HF_TOKEN", "hf_s3cret")
    code = "RUN import os, sys; result = (dict(os.environ), sys.argv)"
    outcomes = {}
    for confined in (False, True):
        pool = VerifierPool(
            payload_module.run_payload,
            num_workers=1,
            timeout_s=60,
            start_method="spawn",
            memory_limit_mb=1024 if confined else None,
        )
        try:
            (outcomes[confined],) = pool.map([(code, "0")])
        finally:
            pool.close()
    assert "s3cret-env" in outcomes[False].answer and "hf_s3cret" in outcomes[False].answer
    assert outcomes[True] == VerifyOutcome("ok", 0.0, repr(({}, [""])))


def test_hook_cannot_be_talked_out_of_refusing(pool, tmp_path):
    """Code in the worker can rebind any module global or builtin: the hook reads none."""
    marker = tmp_path / "pwned"
    sandbox = "sys.modules['tempering.environments.sandbox']"
    attacks = {
        "empty the refused lists, then run a shell": (
            f"import os, sys; s = {sandbox}; s._REFUSED_EVENTS = set(); "
            f"s._REFUSED_PREFIXES = (); os.system('touch {marker}')"
        ),
        "make writes look like reads": (
            f"import sys; {sandbox}._writes = lambda *a: False; open({str(marker)!r}, 'w')"
        ),
        "make every path look like Python's own": (
            "import builtins, posixpath, os, sys\n"
            f"root = {sandbox}.readable_roots()[0] + '/os.py'\n"
            "saved = builtins.isinstance, posixpath.realpath, posixpath.normpath\n"
            "posixpath.realpath = posixpath.normpath = lambda *a, **k: root\n"
            "builtins.isinstance = lambda *a: True\n"
            "try:\n"
            "    result = open('/etc/passwd').read()\n"
            "finally:\n"
            "    builtins.isinstance, posixpath.realpath, posixpath.normpath = saved\n"
        ),
    }
    for what, code in attacks.items():
        outcome = run(pool, code)
        assert outcome.status == "error" and "SandboxViolation" in outcome.answer, (what, outcome)
        assert not marker.exists(), what


HOSTILE_BYTES = {
    "a pickle": lambda marker: frame(pickle.dumps(_CreatesMarker(marker))),
    "garbage": lambda marker: frame(b"\x80\x04\x95garbage\xff\x00"),
    "an oversized message": lambda marker: struct.pack("!i", 2**31 - 1) + b"x" * 100,
    "a negative length": lambda marker: struct.pack("!i", -5),
    "JSON for another sample": lambda marker: frame(
        json.dumps(
            {
                "id": 10**9,
                "status": "ok",
                "reward": 1.0,
                "answer": "x",
                "retire": False,
                "refused": 0,
            }
        ).encode()  # fmt: skip
    ),
}


@pytest.mark.timeout(120)  # the pickle-trusting parent hung on some of these
@pytest.mark.parametrize("sent", list(HOSTILE_BYTES))
def test_parent_never_trusts_what_a_worker_sends(pool, sent, tmp_path):
    """A worker writes its own bytes on its channel: the parent unpickles nothing (the pickle
    would create the marker), scores that sample as a counted error, replaces the worker and
    scores the others as usual."""
    marker = tmp_path / "unpickled"
    code = WRITE_TO_CHANNEL.format(hex=HOSTILE_BYTES[sent](str(marker)).hex())
    errors, replaced = pool.num_protocol_errors, pool.num_replaced
    items = [(f"RUN {code}", "0")] + [(f"\\boxed{{{n}}}", str(n)) for n in range(3)]
    outcomes = pool.map(items)
    assert not marker.exists()
    assert outcomes[0].status == "error" and "protocol violation" in outcomes[0].answer
    assert [o.reward for o in outcomes[1:]] == [1.0, 1.0, 1.0]
    assert pool.num_protocol_errors == errors + 1
    assert pool.num_replaced >= replaced + 1
    assert pool.map([("\\boxed{7}", "7")])[0].reward == 1.0  # the replacement serves


@pytest.mark.timeout(120)
def test_a_worker_that_sends_half_a_message_times_out(pool):
    """Half a frame, then silence: the parent waits no longer than the sample's limit."""
    half = (struct.pack("!i", 100) + b"{").hex()
    code = WRITE_TO_CHANNEL.format(hex=half) + "import time\nwhile True: time.sleep(1)\n"
    outcomes = pool.map([(f"RUN {code}", "0"), ("\\boxed{2}", "2")])
    assert outcomes == [VerifyOutcome("timeout", 0.0, None), VerifyOutcome("ok", 1.0, "2")]


GOOD = {"id": 7, "status": "ok", "reward": 1.0, "answer": "2", "retire": False, "refused": 0}


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe\x00",
        b"[" * 100_000,  # nested past the recursion limit
        b'"just a string"',
        json.dumps([GOOD]).encode(),
        json.dumps({**GOOD, "id": 8}).encode(),
        json.dumps({**GOOD, "id": True}).encode(),
        json.dumps({**GOOD, "id": 7.0}).encode(),
        json.dumps({**GOOD, "extra": 1}).encode(),
        json.dumps({k: v for k, v in GOOD.items() if k != "retire"}).encode(),
        json.dumps({**GOOD, "reward": 1}).encode(),
        json.dumps({**GOOD, "reward": "1.0"}).encode(),
        json.dumps({**GOOD, "reward": float("nan")}).encode(),
        json.dumps({**GOOD, "reward": float("inf")}).encode(),
        json.dumps({**GOOD, "status": "timeout"}).encode(),
        json.dumps({**GOOD, "answer": None}).encode(),
        json.dumps({**GOOD, "answer": ["2"]}).encode(),
        json.dumps({**GOOD, "status": "parse_failure"}).encode(),
        json.dumps({**GOOD, "status": "error", "answer": "E"}).encode(),  # reward must be 0
        json.dumps({**GOOD, "retire": 1}).encode(),
        json.dumps({**GOOD, "refused": -1}).encode(),
        b'{"id": ' + b"9" * 5000 + b"}",  # an int too long to parse
    ],
)
def test_reply_parser_rejects_anything_but_a_well_formed_reply(raw):
    with pytest.raises(ProtocolViolation):
        _parse_reply(raw, 7)


def test_reply_parser_accepts_the_replies_a_worker_sends():
    assert _parse_reply(json.dumps(GOOD).encode(), 7) == (VerifyOutcome("ok", 1.0, "2"), False, 0)
    failure = {**GOOD, "status": "parse_failure", "reward": 0.0, "answer": None, "refused": 2}
    assert _parse_reply(json.dumps(failure).encode(), 7)[::2] == (
        VerifyOutcome("parse_failure", 0.0, None),
        2,
    )


def test_frame_reader_never_blocks_and_never_over_allocates():
    parent, child = socket.socketpair()
    with parent, child:
        reader = FrameReader(parent.fileno(), MAX_REPLY_BYTES)
        assert reader.read() == []  # nothing there: no wait
        child.sendall(frame(b"one") + frame(b"two")[:5])
        assert reader.read() == [b"one"]  # the half frame waits in the buffer
        child.sendall(frame(b"two")[5:])
        assert reader.read() == [b"two"]
        child.sendall(struct.pack("!i", MAX_REPLY_BYTES + 1))
        with pytest.raises(ProtocolViolation, match="limit"):
            reader.read()
        child.close()
        with pytest.raises(EOFError):
            FrameReader(parent.fileno(), 10).read()
