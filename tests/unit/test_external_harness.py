"""External-harness rollouts (tempering/experience/external.py, rollout_capture.py): a harness
that is not tempering code makes its own model calls through the real OpenAI-compatible
server under a rollout id; the trainer rebuilds each episode from what the server recorded.

- the example harness (examples/harness_calculator.py, the plain `openai` client, run as a
  confined subprocess) on the committed tiny-arith model with the real torch engine: every
  episode's row is exactly the ids the backend saw and produced (each call's prompt and
  generation, the sampler's log-probs, the generated tokens and only they trained on), with
  multi-turn episodes spliced through the ids the server re-attached;
- its tool loop: a scripted backend (no model we can build emits tool calls reliably; the
  server, the client and the harness are real) calls the calculator, the harness runs it;
- failed, missing, non-finite, non-contiguous and mixed-version episodes are masked and
  counted; a harness past its deadline is killed; calls under ids that are not open get 404;
- the config refusals, at load (before Ray).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time
from pathlib import Path

import openai
import pytest
import torch

from tempering.config import ConfigError, GRPOMasterConfig, load_config
from tempering.data.grpo_problems import Problem
from tempering.experience.external import ExternalHarness, HarnessSettings, assemble
from tempering.models.generation.chat_service import ChatCompletionService, ServerSettings
from tempering.models.generation.interfaces import SamplingConfig
from tempering.models.generation.openai_server import OpenAIServer
from tempering.models.generation.rollout_capture import CapturedCall, RolloutCapture
from tempering.models.generation.torch_engine import TorchGenerationEngine
from tempering.models.hf import load_causal_lm, load_tokenizer
from tempering.models.tiny_arith import make_problems
from tests.scripted_backend import ScriptedBackend

REPO = Path(__file__).parents[2]
HARNESS = [sys.executable, str(REPO / "examples/harness_calculator.py")]
CALC_TEMPLATE = (
    "{% if tools %}[{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}]"
    " {% endif %}{% for m in messages %}{% if m['role'] == 'tool' %} R: {{ m['content'] }} A:"
    "{% else %}{{ m['content'] }}{% for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ c['function'] | tojson }}</tool_call>{% endfor %}{% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}{% endif %}{% endfor %}"
)


class RecordingBackend:
    """A backend that keeps every row it served: (prompt ids, generated ids, log-probs)."""

    def __init__(self, inner) -> None:
        self.inner, self.rows = inner, []

    def generate(self, data, greedy=False, sampling=None):
        out = self.inner.generate(data, greedy, sampling)
        for b in range(data["input_ids"].shape[0]):
            L, n = int(data["input_lengths"][b]), int(out["generation_lengths"][b])
            self.rows.append((out["output_ids"][b, :L].tolist(),
                              out["output_ids"][b, L : L + n].tolist(),
                              out["logprobs"][b, L : L + n].tolist()))  # fmt: skip
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-arith")


def _serve(backend, tokenizer, max_len=64, template=None):
    settings = ServerSettings(model_name="policy", max_model_len=max_len,
                              default_sampling=SamplingConfig(max_new_tokens=6),
                              chat_template=template)  # fmt: skip
    service = ChatCompletionService(backend, tokenizer, settings)
    service.capture = RolloutCapture(max_calls=16)
    return OpenAIServer(service).start()


def _harness(server, command, **settings) -> ExternalHarness:
    s = HarnessSettings(command=command, timeout_s=settings.pop("timeout_s", 60), **settings)
    return ExternalHarness(s, server.service.capture, server.url, "policy", pad_token_id=0)


def _problems(n: int) -> list[Problem]:
    return [Problem(p["prompt"], p["answer"], "arithmetic") for p in make_problems(n, seed=3)]


def test_example_harness_episodes_are_exactly_the_ids_the_server_served(tokenizer):
    torch.manual_seed(0)
    engine = TorchGenerationEngine(load_causal_lm("tiny-arith"), tokenizer, max_new_tokens=6,
                                   seed=0)  # fmt: skip
    backend = RecordingBackend(engine)
    with_server = _serve(backend, tokenizer)
    try:
        harness = _harness(with_server, [*HARNESS, "--attempts", "3"])
        # greedy (temperature 0 in the tasks): the same episodes however the server batches
        # the concurrent calls; a wrong answer is asked again and answered again, so the
        # episodes run to three turns
        batch = harness.rollouts(_problems(24), sampling=SamplingConfig(max_new_tokens=6),
                                 greedy=True)  # fmt: skip
        _, metrics = harness.global_post_process_and_metrics({})
    finally:
        with_server.stop()
    served = {(tuple(p), tuple(g)): lp for p, g, lp in backend.rows}
    assert metrics["rollouts/external_episodes"] == 24
    assert metrics["rollouts/external_model_calls"] == len(backend.rows)  # every call captured
    assert metrics["rollouts/external_failed"] == metrics["rollouts/external_noncontiguous"] == 0
    multi = batch["turns"] > 1
    assert int(multi.sum()) >= 3, "too few retried episodes to test the splice"
    # every plain assistant message sent back got the ids the server had recorded (turn k's
    # request carries k - 1 of them)
    turns = batch["turns"].tolist()
    assert metrics["rollouts/external_ids_attached"] == sum(t * (t - 1) // 2 for t in turns)
    seen_calls = 0
    for b in range(24):
        L = int(batch["input_lengths"][b])
        ids = batch["input_ids"][b, :L].tolist()
        mask = batch["token_mask"][b, :L].tolist()
        # the row splits into served calls: each call's prompt is the row's prefix, its
        # generation follows, and only generated tokens are trained on, with their log-probs
        trained = [i for i, m in enumerate(mask) if m]
        starts = [p for p in range(L) if mask[p] and (p == 0 or not mask[p - 1])]
        ends = [p for p in range(1, L + 1) if mask[p - 1] and (p == L or not mask[p])]
        covered = []
        for s, e in zip(starts, ends, strict=True):
            key = (tuple(ids[:s]), tuple(ids[s:e]))
            assert key in served, f"episode {b}: a span the backend never produced"
            assert batch["generation_logprobs"][b, s:e].tolist() == pytest.approx(served[key])
            covered += range(s, e)
            seen_calls += 1
        assert covered == trained
        assert len(starts) == int(batch["turns"][b])
        assert ends[-1] == L  # the row ends with the last call's generation
    assert seen_calls == len(backend.rows)


def test_the_harness_tool_loop_is_captured_and_spliced(tokenizer):
    """Scripted replies: a calculator call first, the tool's result answered next."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "23+45"}}</tool_call>'
    backend = RecordingBackend(
        ScriptedBackend(tokenizer, lambda p: " 68" if "R: 68" in p else call)
    )
    srv = _serve(backend, tokenizer, max_len=256, template=CALC_TEMPLATE)
    try:
        harness = _harness(srv, [*HARNESS, "--tools"])
        batch = harness.rollouts([Problem("Q: 23+45=? A:", "68", "arithmetic")],
                                 sampling=SamplingConfig(max_new_tokens=64), repeat=2)  # fmt: skip
        _, metrics = harness.global_post_process_and_metrics({})
    finally:
        srv.stop()
    assert batch["rewards"].tolist() == [1.0, 1.0] and batch["turns"].tolist() == [2, 2]
    assert batch["sample_mask"].tolist() == [1.0, 1.0]
    assert metrics["rollouts/external_ids_attached"] == 2  # the tool-call turn, re-attached
    (p1, g1, _), (p2, _, _) = backend.rows[0], backend.rows[2]  # episode 0's two calls
    assert p2[: len(p1) + len(g1)] == p1 + g1  # spliced onto the generated ids
    text = tokenizer.decode(batch["input_ids"][0, : int(batch["input_lengths"][0])])
    assert "R: 68 A:" in text  # the tool's result, in the prompt, not trained on


def _call(prompt, gen, version=0) -> CapturedCall:
    return CapturedCall(prompt, gen, [-0.1] * len(gen), [version] * len(gen), "stop",
                        {"role": "assistant", "content": ""})  # fmt: skip


def test_assemble_masks_and_names_what_cannot_be_trained_on():
    ok = [_call([1, 2], [3, 4]), _call([1, 2, 3, 4, 9, 5], [6])]
    record, why = assemble(ok, {"reward": 1.0})
    assert why is None and record.ids == [1, 2, 3, 4, 9, 5, 6] and record.turns == 2
    assert [s[0] for s in record.spans] == [2, 6] and not record.masked
    cases = {
        "failed": [(ok, {"error": "boom"}), (ok, None), (ok, {"reward": math.nan}),
                   (ok, {"reward": "1"}), (ok, {"reward": True}), ([], {"reward": 1.0})],
        "noncontiguous": [([_call([1, 2], [3]), _call([1, 7, 3], [4])], {"reward": 1.0})],
        "mixed_weight_versions": [([_call([1], [2], 0), _call([1, 2], [3], 1)], {"reward": 1})],
    }  # fmt: skip
    for reason, items in cases.items():
        for calls, result in items:
            record, why = assemble(calls, result)
            assert why == reason, (reason, calls, result)
            assert record.masked and record.spans == []  # no token of it is trained on


def test_failures_are_masked_and_counted_and_a_late_harness_is_killed(tokenizer, tmp_path):
    """A harness (plain urllib) that answers each episode differently: one right, one with an
    error, one with no result, one non-finite, one restarting its history (non-contiguous);
    and one that never returns."""
    script = tmp_path / "odd_harness.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys, urllib.request
        def ask(url, model, messages):
            body = json.dumps({"model": model, "messages": messages, "max_tokens": 4}).encode()
            req = urllib.request.Request(url + "/chat/completions", body,
                                         {"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(req).read())["choices"][0]["message"]
        for k, line in enumerate(sys.stdin):
            t = json.loads(line)
            first = ask(t["base_url"], t["model"], t["messages"])
            out = {"rollout_id": t["rollout_id"], "reward": 1.0}
            if k == 1: out = {"rollout_id": t["rollout_id"], "error": "tool crashed"}
            if k == 2: continue
            if k == 3: out["reward"] = float("nan")
            if k == 4: ask(t["base_url"], t["model"], [{"role": "user", "content": "Q: 1+1=? A:"}])
            print(json.dumps(out))
    """)
    )
    backend = ScriptedBackend(tokenizer, lambda p: " 5")
    srv = _serve(backend, tokenizer)
    try:
        harness = _harness(srv, [sys.executable, str(script)])
        batch = harness.rollouts(_problems(5), sampling=SamplingConfig(max_new_tokens=4))
        _, m = harness.global_post_process_and_metrics({})
        assert batch["sample_mask"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert batch["token_mask"][1:].sum() == 0  # masked rows train no token
        assert (m["rollouts/external_failed"], m["rollouts/external_noncontiguous"]) == (3, 1)
        assert m["rollouts/external_episodes"] == 5

        stuck = _harness(srv, [sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1)
        t0 = time.monotonic()
        batch = stuck.rollouts(_problems(3), sampling=SamplingConfig(max_new_tokens=4))
        assert time.monotonic() - t0 < 15
        assert batch["sample_mask"].tolist() == [0.0] * 3
        assert stuck.global_post_process_and_metrics({})[1]["rollouts/external_failed"] == 3

        client = openai.OpenAI(base_url=f"{srv.url}/rollouts/not-issued/v1", api_key="x",
                               max_retries=0)  # fmt: skip
        with pytest.raises(openai.NotFoundError, match="is not open on this server"):
            client.chat.completions.create(model="policy", messages=[{"role": "user",
                                                                        "content": "Q"}])  # fmt: skip
    finally:
        srv.stop()


def test_the_harness_environment_holds_no_trainer_secrets(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-of-the-trainer")
    script = tmp_path / "env_harness.py"
    script.write_text(
        "import json, os, sys\n"
        "for line in sys.stdin:\n"
        "    t = json.loads(line)\n"
        "    print(json.dumps({'rollout_id': t['rollout_id'], 'error': json.dumps(sorted(os.environ))}))\n"
    )
    srv = _serve(ScriptedBackend(tokenizer, lambda p: " 5"), tokenizer)
    try:
        harness = _harness(srv, [sys.executable, str(script)], env={"MY_HARNESS_FLAG": "1"})
        tasks = [{"rollout_id": "a", "base_url": "", "model": "policy", "messages": []}]
        (result,) = harness.run(tasks).values()
    finally:
        srv.stop()
    names = set(json.loads(result["error"]))
    assert "HF_TOKEN" not in names and {"OPENAI_API_KEY", "MY_HARNESS_FLAG"} <= names


BASE = ["grpo.rollout_transport=external", "policy.generation.http_server.enabled=true"]


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["grpo.rollout_transport=external"], "set policy.generation.http_server.enabled=true"),
        (BASE, "needs exactly one of grpo.external_harness.command"),
        ([*BASE, "grpo.external_harness.command=[python]",
          "grpo.external_harness.endpoint=http://h:1"], "needs exactly one of"),
        ([*BASE, "grpo.external_harness.command=[no-such-harness-binary]"],
         "is not an executable on PATH"),
        ([*BASE, "grpo.external_harness.endpoint=ftp://h"], "is not an http(s) URL"),
        ([*BASE, "grpo.external_harness.command=[python]", "grpo.max_rollout_turns=3"],
         "the harness decides its own turns"),
        ([*BASE, "grpo.external_harness.command=[python]", "grpo.async_grpo.enabled=true"],
         "collected synchronously"),
    ],
)  # fmt: skip
def test_external_config_refusals_come_at_load(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(REPO / "examples/configs/grpo_math_tiny.yaml", overrides,
                    schema=GRPOMasterConfig)  # fmt: skip


def test_the_shipped_external_config_loads():
    cfg, _ = load_config(REPO / "examples/configs/grpo_external_harness_tiny.yaml", [],
                         schema=GRPOMasterConfig)  # fmt: skip
    assert cfg.grpo.rollout_transport == "external"
    assert cfg.grpo.external_harness.command[1] == "examples/harness_calculator.py"


def test_an_endpoint_harness_is_posted_its_tasks_and_its_results_count(tokenizer):
    """``grpo.external_harness.endpoint``: a harness service (here a thread of this process,
    stdlib only) gets ``{"tasks": [...]}``, calls the model under each task's base URL and
    answers ``{"results": [...]}``; an unreachable endpoint fails its episodes, counted."""
    import http.server
    import threading
    import urllib.request

    class Harness(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            tasks = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["tasks"]
            results = []
            for t in tasks:
                body = json.dumps({"model": t["model"], "messages": t["messages"]}).encode()
                req = urllib.request.Request(f"{t['base_url']}/chat/completions", body,
                                             {"Content-Type": "application/json"})  # fmt: skip
                reply = json.loads(urllib.request.urlopen(req).read())["choices"][0]["message"]
                results.append({"rollout_id": t["rollout_id"],
                                "reward": float(reply["content"].strip() == t["answer"])})  # fmt: skip
            out = json.dumps({"results": results}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    endpoint = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Harness)
    threading.Thread(target=endpoint.serve_forever, daemon=True).start()
    srv = _serve(ScriptedBackend(tokenizer, lambda p: " 5"), tokenizer)
    try:
        url = f"http://127.0.0.1:{endpoint.server_address[1]}/episodes"
        s = HarnessSettings(endpoint=url, processes=2, timeout_s=30)
        harness = ExternalHarness(s, srv.service.capture, srv.url, "policy")
        problems = [Problem("Q: 2+3=? A:", "5", "arithmetic"), Problem("Q: 2+2=? A:", "4", "x")]
        batch = harness.rollouts(problems, sampling=SamplingConfig(max_new_tokens=4), repeat=2)
        _, m = harness.global_post_process_and_metrics({})
        assert batch["rewards"].tolist() == [1.0, 1.0, 0.0, 0.0]
        assert batch["sample_mask"].tolist() == [1.0] * 4 and m["rollouts/external_failed"] == 0
        assert m["rollouts/external_model_calls"] == 4
        endpoint.shutdown()
        endpoint.server_close()
        batch = harness.rollouts(problems, sampling=SamplingConfig(max_new_tokens=4))
        assert batch["sample_mask"].tolist() == [0.0, 0.0]
        assert harness.global_post_process_and_metrics({})[1]["rollouts/external_failed"] == 2
    finally:
        srv.stop()
