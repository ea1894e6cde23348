"""`RewardModelEnvironment`: score rollouts with a trained reward model (task "reward_model").

It loads an HF folder written by `tempering.algorithms.rm` (``examples/run_rm.py``; GRPO's
``env.reward_model_path``) with ``AutoModelForSequenceClassification`` and scores each
conversation: the message log (prompt messages + the last assistant message) is tokenized
exactly as the reward model saw its training pairs (`tokenize_message_log`, i.e. the chat
template if the tokenizer has one, else plain concatenation with EOS after the assistant
turn), right-padded with the pad token, and the score is read at the last non-pad token.

Reward: ``reward_transform="raw"`` (default) gives the score itself, an unbounded logit
whose differences are Bradley-Terry log-odds; ``"sigmoid"`` gives ``sigmoid(score)`` in
(0, 1) (the probability that the completion beats one scored 0). GRPO's advantages are
invariant to a constant shift, so "raw" is the natural choice; "sigmoid" bounds outliers.

A message longer than ``max_seq_len * MAX_CHARS_PER_TOKEN`` characters is clipped to that
before tokenizing, and counted (``env/reward_model_clipped``): the conversation is cut to
``max_seq_len`` tokens anyway, and a megabyte answer took the tokenizer many seconds. Text a
tokenizer cannot encode (lone surrogates, which a JSON client can send) is encoded with
them replaced by "?" and counted (``env/reward_model_unencodable``); a conversation that still
fails to tokenize scores 0 and is counted (``env/reward_model_errors``), and more than
``max_error_rate`` of a step's conversations failing raises `ScoringErrorRateExceeded`.

    env = RewardModelEnvironment("results/rm_tiny_arith/final_hf")
    ret = env.step([[{"role": "user", "content": "Q: 2+3=? A:"},
                     {"role": "assistant", "content": " 5"}]], [{}])
    ret.rewards  # tensor([score])
"""

from __future__ import annotations

from typing import Any, Literal

from tempering.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    MessageLog,
    check_error_rate,
    last_assistant_content,
)

RewardTransform = Literal["raw", "sigmoid"]
MAX_CHARS_PER_TOKEN = 64  # beyond max_seq_len tokens for any tokenizer with tokens this short


class RewardModelEnvironment(EnvironmentInterface):
    """Rewards from a Bradley-Terry reward model (see the module docstring): scores, not
    correctness (``correct_above`` None), so GRPO reports no accuracy for them.

    Args:
        reward_model_path: an exported reward-model folder (config, weights, tokenizer).
        reward_transform: "raw" (the score) or "sigmoid" (sigmoid of the score).
        max_seq_len: conversations are cut to this many tokens (from the start).
        batch_size: rows per forward pass.
        num_threads: torch threads (CPU); None leaves torch's default.
        max_error_rate: the fraction of a step's conversations that may fail to tokenize
            (scored 0, counted) before the step raises.
    """

    correct_above = None

    def __init__(
        self,
        reward_model_path: str,
        reward_transform: RewardTransform = "raw",
        max_seq_len: int = 512,
        batch_size: int = 64,
        num_threads: int | None = None,
        max_error_rate: float = 0.05,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from tempering.models.hf import load_tokenizer

        if reward_transform not in ("raw", "sigmoid"):
            raise ValueError(
                f"reward_transform={reward_transform!r} is unknown; use 'raw' or 'sigmoid'"
            )
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.tokenizer = load_tokenizer(reward_model_path)
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                reward_model_path, dtype=torch.float32
            ).eval()
        except OSError as err:
            raise FileNotFoundError(
                f"reward model folder {reward_model_path!r} could not be loaded ({err}); pass the "
                "folder written by examples/run_rm.py (<checkpoint_dir>/final_hf)"
            ) from err
        if self.model.config.num_labels != 1 or self.model.config.pad_token_id is None:
            raise ValueError(
                f"{reward_model_path}: num_labels={self.model.config.num_labels}, pad_token_id="
                f"{self.model.config.pad_token_id}; a reward model needs num_labels=1 and a "
                "pad_token_id (export it with examples/run_rm.py)"
            )
        self.reward_transform = reward_transform
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.max_error_rate = max_error_rate
        self._counts = {"clipped": 0, "unencodable": 0, "errors": 0}

    def _token_ids(self, message_logs: list[MessageLog]) -> list[list[int] | None]:
        """Each conversation's token ids, or None where it cannot be tokenized (counted; the
        step raises when more than ``max_error_rate`` of them fail)."""
        from tempering.data.processing import tokenize_message_log

        out: list[list[int] | None] = []
        errors: list[tuple[int, str, str]] = []
        for i, log in enumerate(message_logs):
            plain, clipped, replaced = _plain(log, self.max_seq_len * MAX_CHARS_PER_TOKEN)
            self._counts["clipped"] += clipped
            self._counts["unencodable"] += replaced
            try:
                out.append(
                    tokenize_message_log(plain, self.tokenizer, self.max_seq_len)["input_ids"]
                )
            except (ValueError, TypeError, RecursionError) as exc:
                errors.append((i, last_assistant_content(log), f"{type(exc).__name__}: {exc}"))
                out.append(None)
        self._counts["errors"] += len(errors)
        check_error_rate(
            "RewardModelEnvironment", errors, len(message_logs), self.max_error_rate,
            "Check the reward model's tokenizer and chat template.",
        )  # fmt: skip
        return out

    def score(self, message_logs: list[MessageLog]) -> Any:
        """Raw scores ``[B]`` (float32) of whole conversations; 0 for one that could not be
        tokenized (see `_token_ids`)."""
        import torch

        pad = int(self.model.config.pad_token_id)
        all_ids = self._token_ids(message_logs)
        failed = torch.tensor([x is None for x in all_ids], dtype=torch.bool)
        out = []
        for start in range(0, len(message_logs), self.batch_size):
            ids = [x or [pad] for x in all_ids[start : start + self.batch_size]]
            lengths = torch.tensor([max(len(x), 1) for x in ids])
            batch = torch.full((len(ids), int(lengths.max())), pad, dtype=torch.long)
            for i, x in enumerate(ids):
                batch[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask = (torch.arange(batch.shape[1])[None, :] < lengths[:, None]).long()
            with torch.no_grad():
                out.append(self.model(input_ids=batch, attention_mask=mask).logits[:, 0].float())
        scores = torch.cat(out) if out else torch.zeros(0)
        return scores.masked_fill(failed, 0.0)

    def step(
        self, message_logs: list[MessageLog], metadata: list[dict[str, Any]]
    ) -> EnvironmentReturn:
        import torch

        scores = self.score(message_logs)
        rewards = torch.sigmoid(scores) if self.reward_transform == "sigmoid" else scores
        n = len(message_logs)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""} for _ in range(n)],
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=rewards,
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=[last_assistant_content(log) for log in message_logs],
        )

    def global_post_process_and_metrics(
        self, batch: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, float]]:
        metrics = {f"env/reward_model_{k}": float(v) for k, v in self._counts.items()}
        self._counts = dict.fromkeys(self._counts, 0)
        rewards = batch.get("rewards")
        if rewards is not None and len(rewards):
            metrics["reward_model_score_mean"] = float(rewards.float().mean())
        return batch, metrics


def _plain(log: MessageLog, max_chars: int) -> tuple[MessageLog, int, int]:
    """role/content only (message logs may carry token_ids and other keys), each content cut
    to `max_chars` and with characters UTF-8 cannot encode (lone surrogates) replaced by "?";
    and how many messages were clipped, how many had such characters."""
    out, clipped, replaced = [], 0, 0
    for m in log:
        role, content = (str(m.get(k) or "") for k in ("role", "content"))
        if len(content) > max_chars:
            content, clipped = content[:max_chars], clipped + 1
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            content = content.encode("utf-8", "replace").decode("utf-8")
            replaced += 1
        out.append({"role": role, "content": content})
    return out, clipped, replaced
