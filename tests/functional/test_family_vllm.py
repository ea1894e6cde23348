"""Every model family through vLLM on CPU (slow tier): the vLLM generation worker samples from
a tiny random model of the family, then takes a refit of a second model's weights in place,
and each time its sampling log-probs equal a Hugging Face forward of the same tokens. Where
vLLM on CPU refits a family wrongly (Qwen3-MoE: its experts stay in checkpoint layout), the
refit test fails strictly and the family's registry entry refuses vLLM on CPU at start-up.

One subprocess in the vLLM extra's own venv (as in test_vllm_generation.py, to spare Ray's
start-up) starts one engine per family in turn -- ``import vllm`` is paid once. Models are
`build_tiny` at `VLLM_CPU_SHAPE` (vLLM's CPU attention has no head size 16), prompts in the
family's chat template, fp32 on both sides, so log-probs agree to vLLM's summation order
(1e-3, as in test_vllm_generation.py). A family the engine cannot run fails here with
vLLM's own error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tempering.models.families import FAMILIES, VLLM_CPU_SHAPE, build_tiny

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]
NAMES = sorted(FAMILIES)
LOGPROB_ATOL = 1e-3
QUESTIONS = ["Q: 1+2=? A:", "Q: 40+2=? A:"]
SAMPLES = 2
MAX_NEW_TOKENS = 8

DRIVER = textwrap.dedent(
    """
    import json, os, sys, time, traceback
    import torch
    from safetensors.torch import load_file

    def main():
        args = json.loads(sys.argv[1])
        from tempering.models.generation.vllm_worker import VllmGenerationWorker
        from tempering.distributed.batched_data_dict import BatchedDataDict
        results = {}
        for name, job in args["families"].items():
            t0 = time.perf_counter()
            try:
                worker = VllmGenerationWorker(
                    job["model_a"], dtype="float32", enforce_eager=True, max_model_len=256,
                    kv_cache_memory_bytes=64 * 2**20, temperature=1.0,
                    max_new_tokens=args["max_new_tokens"], seed=0,
                )
                data = BatchedDataDict(input_ids=torch.tensor(job["input_ids"]),
                                       input_lengths=torch.tensor(job["input_lengths"]))
                before = dict(worker.generate(data))
                worker.update_weights(load_file(job["model_b"] + "/model.safetensors"))
                after = dict(worker.generate(data))
                worker.shutdown()
                results[name] = {"before": before, "after": after,
                                 "seconds": time.perf_counter() - t0}
            except Exception:
                results[name] = {"error": traceback.format_exc()[-3000:]}
        torch.save(results, args["out"])
        sys.stdout.flush()
        os._exit(0)  # skip the interpreter's slow teardown of vLLM's threads

    if __name__ == "__main__":
        main()
    """
)


def _prompts(folder: Path) -> tuple[list[list[int]], list[int]]:
    """Each question in the family's chat template, SAMPLES times, right-padded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    rows = []
    for q in QUESTIONS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        rows += [tok(text, add_special_tokens=False)["input_ids"]] * SAMPLES
    width = max(len(r) for r in rows)
    return [r + [tok.pad_token_id] * (width - len(r)) for r in rows], [len(r) for r in rows]


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory) -> dict:
    from tests.functional.test_vllm_generation import _vllm_python

    python = _vllm_python()
    root = tmp_path_factory.mktemp("family_vllm")
    jobs = {}
    for name in NAMES:
        a = build_tiny(name, root / f"{name}_a", seed=0, shape=VLLM_CPU_SHAPE)
        b = build_tiny(name, root / f"{name}_b", seed=1, shape=VLLM_CPU_SHAPE)
        ids, lengths = _prompts(a)
        jobs[name] = {"model_a": str(a), "model_b": str(b), "input_ids": ids,
                      "input_lengths": lengths}  # fmt: skip
    (root / "driver.py").write_text(DRIVER)
    args = {"families": jobs, "max_new_tokens": MAX_NEW_TOKENS, "out": str(root / "out.pt")}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2"}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(
        [python, str(root / "driver.py"), json.dumps(args)],
        env=env, capture_output=True, text=True, timeout=1100,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"vLLM driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    results = torch.load(root / "out.pt", weights_only=False)
    for name, r in results.items():
        print(f"vLLM {name}: {r.get('seconds', 'error')}", file=sys.stderr)
    return {"results": results, "jobs": jobs}


def _hf_logprobs(folder: str, out: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(HF's log-probs of the generated tokens, vLLM's), on the generated positions."""
    from tempering.distributed.batched_data_dict import BatchedDataDict
    from tests.functional.test_family_pipelines import _plain_logprobs

    ids, total = out["output_ids"], out["unpadded_sequence_lengths"]
    hf = _plain_logprobs(Path(folder), BatchedDataDict(input_ids=ids, input_lengths=total))
    prompt = total - out["generation_lengths"]
    cols = torch.arange(ids.shape[1])[None]
    generated = (cols >= prompt[:, None]) & (cols < total[:, None])
    return hf[generated], out["logprobs"][generated]


def _check(name: str, key: str, folder: str, out: dict) -> None:
    assert int(out["generation_lengths"].sum()) > 0
    hf, vllm = _hf_logprobs(folder, out)
    diff = float((hf - vllm).abs().max())
    assert diff < LOGPROB_ATOL, f"{name} {key}: vLLM vs HF log-probs differ by {diff:.2e}"


def _result(vllm_results: dict, name: str) -> dict:
    r = vllm_results["results"][name]
    assert "error" not in r, f"vLLM on CPU cannot run {name}:\n{r.get('error')}"
    return r


@pytest.mark.parametrize("name", NAMES)
def test_vllm_samples_the_family(vllm_results, name):
    r, job = _result(vllm_results, name), vllm_results["jobs"][name]
    _check(name, "first load", job["model_a"], r["before"])


REFIT_REFUSED = {n for n, f in FAMILIES.items() if f.vllm_cpu_refit_refusal}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(
            strict=True, reason=f"refused at start-up: {FAMILIES[n].vllm_cpu_refit_refusal}"))
        if n in REFIT_REFUSED else n
        for n in NAMES
    ],
)  # fmt: skip
def test_vllm_takes_the_familys_refit(vllm_results, name):
    """After a refit the engine samples from the new weights (strictly failing where the
    family's refusal says vLLM on CPU gets it wrong: fixed upstream, the refusal goes)."""
    r, job = _result(vllm_results, name), vllm_results["jobs"][name]
    # the refit changed what the engine computes (model b is another random model)...
    hf_a, vllm_b = _hf_logprobs(job["model_a"], r["after"])
    assert float((hf_a - vllm_b).abs().max()) > 10 * LOGPROB_ATOL
    _check(name, "after refit", job["model_b"], r["after"])  # ...into exactly model b
