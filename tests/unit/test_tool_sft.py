"""SFT on tool-calling conversations (TRL's ``messages`` + ``tools`` columns).

A row's assistant messages may call tools (OpenAI ``tool_calls``, content null), ``tool``
messages carry the results, and ``tools`` lists the function specs. Before, such a row was
refused ("role is 'tool'"). Now it loads as a `Conversation`, renders exactly as the
generation server renders the same messages (so the model is trained on the prompts it is
later served), and only the assistant turns - tool calls included - are in the loss.
"""

from __future__ import annotations

import json

import pytest

from tempering.data.messages import Conversation
from tempering.data.processing import (
    ChatTemplateError,
    tokenize_message_log,
    tokenize_message_logs,
)
from tempering.data.records import DataFormatError
from tempering.data.sft_datasets import load_messages_jsonl
from tempering.environments.calculator import CALCULATOR_TOOL
from tempering.models.generation.chat import ChatPromptBuilder, parse_hermes_tool_calls
from tests.unit.test_processing import CHATML, make_tokenizer

CALL = {"id": "c1", "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "23*45"}'}}  # fmt: skip
MESSAGES = [
    {"role": "user", "content": "What is 23*45?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "1035"},
    {"role": "assistant", "content": "The answer is 1035."},
]
# A Qwen2.5-style template (our own Jinja): it renders `tools` and `tool_calls` itself, and
# groups consecutive tool results under one user turn, so a prefix of the conversation that
# ends inside the group renders differently once the next result follows.
GROUPING = (
    "{%- if tools %}<|im_start|>system{{ '\\n' }}Tools: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}"
    "<|im_end|>{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>{{ m.content }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}{{ '\\n' }}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _spans(tokenizer, example) -> list[str]:
    """The text of each run of loss tokens."""
    spans, run = [], []
    for tok, m in zip(example["input_ids"], example["token_mask"], strict=True):
        if m:
            run.append(tok)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans + ([tokenizer.decode(run)] if run else [])


def test_tool_rows_load_alike_from_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    as_text = {"messages": MESSAGES, "tools": json.dumps([CALCULATOR_TOOL])}  # hub style
    as_objects = {
        "messages": [*MESSAGES[:1],
                     {"role": "assistant", "tool_calls": [{**CALL, "function": {
                         "name": "calculator", "arguments": {"expression": "23*45"}}}]},
                     *MESSAGES[2:]],
        "tools": [CALCULATOR_TOOL["function"]],  # a bare spec
    }  # fmt: skip
    plain = {"messages": [MESSAGES[0], MESSAGES[3]]}
    jsonl = load_messages_jsonl(_write_jsonl(tmp_path / "t.jsonl", [as_text, as_objects, plain]))
    first, second, third = jsonl.examples
    assert isinstance(first, Conversation) and first == second
    assert first.tools == [CALCULATOR_TOOL]
    assert first.messages[1] == {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "calculator", "arguments": {"expression": "23*45"}}}],
    }  # fmt: skip
    assert third == [MESSAGES[0], MESSAGES[3]]  # no tools: a plain message log
    examples, _ = tokenize_message_logs(jsonl.examples, make_tokenizer(), 4096)  # as SFT does
    assert examples[0] == examples[1] and all(any(e["token_mask"]) for e in examples)
    assert len(examples[0]["input_ids"]) > len(examples[2]["input_ids"]) + 20  # tools, calls
    # Parquet unifies the nested fields across rows: absent ones read back as null
    pq.write_table(pa.Table.from_pylist([as_text, plain]), tmp_path / "t.parquet")
    assert load_messages_jsonl(tmp_path / "t.parquet").examples == [first, third]


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda m: m.pop(1), "[1] is a tool message, but no assistant tool call comes right"),
        (lambda m: m[2].update(tool_call_id="c9"), "[2].tool_call_id is 'c9'; the calls"),
        (lambda m: m[1]["tool_calls"][0]["function"].update(arguments="{expr"),
         "tool_calls[0].function.arguments is not valid JSON"),
        (lambda m: m[0].update(tool_calls=[CALL]), "is a user message with tool_calls"),
        (lambda m: m[1].update(tool_calls=[{"function": {"arguments": "{}"}}]),
         "tool_calls[0].function.name must be a non-empty string"),
        (lambda m: m[2].update(content=None), "[2].content must be str, got NoneType"),
        (lambda m: m[3].update(weight=0), "[3] (assistant) has 'weight', which is not read"),
        (lambda m: m[0].update(name="ann"), "[0] (user) has 'name', which is not read"),
    ],
)  # fmt: skip
def test_a_bad_tool_row_is_named(tmp_path, edit, said):
    messages = json.loads(json.dumps(MESSAGES))
    edit(messages)
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": MESSAGES}, {"messages": messages}])
    with pytest.raises(DataFormatError, match="bad.jsonl:2: ") as err:
        load_messages_jsonl(path)
    assert said in str(err.value)
    bad_tools = _write_jsonl(tmp_path / "tools.jsonl", [{"messages": MESSAGES, "tools": "[{"}])
    with pytest.raises(DataFormatError, match="tools.jsonl:1: field 'tools' is a string but not"):
        load_messages_jsonl(bad_tools)


@pytest.mark.parametrize("template", [CHATML, GROUPING], ids=["no-tool-template", "grouping"])
def test_the_loss_covers_the_assistant_turns_and_the_prompt_is_the_servers(tmp_path, template):
    """The model learns the calls and the answer, not the tool prompt or the results; the text
    before each assistant turn is, token for token, the prompt the server builds from the same
    messages and tools; and a learned call parses back with the server's parser."""
    tokenizer = make_tokenizer(template)
    parallel = [MESSAGES[0],
                {"role": "assistant", "content": "", "tool_calls": [
                    CALL, {**CALL, "id": "c2", "function": {"name": "calculator",
                                                            "arguments": '{"expression": "1+1"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "1035"},
                {"role": "tool", "tool_call_id": "c2", "content": "2"},
                MESSAGES[3]]  # fmt: skip
    rows = [{"messages": parallel, "tools": [CALCULATOR_TOOL]}]
    (conv,) = load_messages_jsonl(_write_jsonl(tmp_path / "p.jsonl", rows)).examples
    example = tokenize_message_log(conv.messages, tokenizer, 4096, tools=conv.tools)
    calls_text, answer = _spans(tokenizer, example)
    parsed = parse_hermes_tool_calls(calls_text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parsed.tool_calls] == [("calculator", {"expression": "23*45"}),
                                            ("calculator", {"expression": "1+1"})]  # fmt: skip
    assert answer == "The answer is 1035.<|im_end|>\n"
    server = ChatPromptBuilder(tokenizer)
    ids, mask = example["input_ids"], example["token_mask"]
    for k in (1, 4):  # each assistant turn starts where the server's prompt ends
        prompt = server.encode(conv.messages[:k], tools=conv.tools).ids
        assert ids[: len(prompt)] == prompt
        assert mask[len(prompt) - 1 : len(prompt) + 1] == [0, 1]
    assert not any(mask[: len(server.encode(conv.messages[:1], tools=conv.tools).ids)])
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "calculator" in unmasked and "<tool_response>" in unmasked and "1035" in unmasked
    if template == GROUPING:  # why the pieces are cut at assistant turns only
        render = lambda n: server.render(parallel[:n], conv.tools, add_generation_prompt=False)  # noqa: E731
        assert not render(4).startswith(render(3))


def test_a_tokenizer_without_a_template_refuses_tool_calls_by_name():
    with pytest.raises(ChatTemplateError, match="needs a chat template to render them.*Fix: set "
                       "policy.tokenizer.chat_template"):  # fmt: skip
        tokenize_message_log(MESSAGES, make_tokenizer(None), 512)


def test_preference_pairs_carry_their_tools(tmp_path):
    """DPO/RM rows read ``tools`` too: a pair whose chosen response calls the tool is scored
    on the call, with the tool specs in its prompt (they were dropped without a word)."""
    from tempering.data.collate import collate_preference
    from tempering.data.preference_datasets import load_preference_jsonl

    row = {"prompt": MESSAGES[:1], "chosen": [MESSAGES[1]],
           "rejected": [{"role": "assistant", "content": "no idea"}],
           "tools": [CALCULATOR_TOOL]}  # fmt: skip
    (pair,) = load_preference_jsonl(_write_jsonl(tmp_path / "p.jsonl", [row])).examples
    assert pair.tools == [CALCULATOR_TOOL]
    tokenizer = make_tokenizer()
    batch = collate_preference([pair], tokenizer, 4096)
    ids, mask = batch["input_ids"][0].tolist(), batch["token_mask"][0].tolist()
    (call,) = _spans(tokenizer, {"input_ids": ids, "token_mask": mask})
    assert parse_hermes_tool_calls(call).tool_calls[0]["function"]["name"] == "calculator"
    prompt = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert '"name": "calculator"' in prompt  # the tool prompt, before the response


REASONING = [{"role": "user", "content": "What is 23*45?"},
             {"role": "assistant", "reasoning_content": "20*45 is 900, 3*45 is 135.",
              "content": "1035"}]  # fmt: skip


@pytest.mark.parametrize(
    ("template", "trained"),
    [(CHATML, "<think>\n20*45 is 900, 3*45 is 135.\n</think>\n\n1035<|im_end|>\n"),
     (CHATML.replace("{{ m['content'] }}", "{% if m.reasoning_content %}[{{ m.reasoning_content }}]"
                     "{% endif %}{{ m['content'] }}"),
      "[20*45 is 900, 3*45 is 135.]1035<|im_end|>\n")],
    ids=["think-tags", "the-template's-own"],
)  # fmt: skip
def test_an_assistants_reasoning_is_trained_on_not_dropped(tmp_path, template, trained):
    """A reasoning dataset's ``reasoning_content`` was dropped without a word when the log was
    copied; now the template renders it, or it goes in <think> tags before the answer."""
    path = _write_jsonl(tmp_path / "r.jsonl", [{"messages": REASONING}])
    (log,) = load_messages_jsonl(path).examples
    tokenizer = make_tokenizer(template)
    assert _spans(tokenizer, tokenize_message_log(log, tokenizer, 4096)) == [trained]
    bad = [{**REASONING[0], "reasoning_content": "hmm"}, REASONING[1]]
    with pytest.raises(DataFormatError, match=r"\[0\]\.reasoning_content must be a str on an "):
        load_messages_jsonl(_write_jsonl(tmp_path / "bad.jsonl", [{"messages": bad}]))


def test_conversational_prompt_completion_rows_train_on_the_completion_only(tmp_path):
    """TRL's prompt-completion rows with message lists (`data.response_key=completion`): a
    few-shot assistant turn inside the prompt is context, not a target. Before, a list
    prompt was refused ("field 'prompt' must be str")."""
    from tempering.data.sft_datasets import load_prompt_response_jsonl

    few_shot = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"},
                MESSAGES[0]]  # fmt: skip
    rows = [{"prompt": few_shot, "completion": MESSAGES[1:], "tools": [CALCULATOR_TOOL]},
            {"prompt": few_shot, "completion": "1035"},
            {"prompt": "What is 23*45?", "completion": "1035"}]  # fmt: skip
    path = _write_jsonl(tmp_path / "pc.jsonl", rows)
    tool_row, text_row, plain = load_prompt_response_jsonl(path, response_key="completion").examples
    assert (tool_row.loss_from, text_row.loss_from) == (3, 3) and text_row.tools == []
    assert plain == [{"role": "user", "content": "What is 23*45?"},
                     {"role": "assistant", "content": "1035"}]  # fmt: skip
    tokenizer = make_tokenizer()
    examples, _ = tokenize_message_logs([tool_row, text_row], tokenizer, 4096)
    spans = [_spans(tokenizer, e) for e in examples]
    assert spans[1] == ["1035<|im_end|>\n"]  # not the few-shot "2"
    assert spans[0][-1] == "The answer is 1035.<|im_end|>\n" and len(spans[0]) == 2
    assert parse_hermes_tool_calls(spans[0][0]).tool_calls[0]["function"]["name"] == "calculator"


# Qwen3's rule (our own Jinja): an assistant turn's reasoning is rendered only after the last
# user message, so a turn's thinking disappears from the text once the user speaks again.
DROPS_OLD_REASONING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}{{ '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user %}"
    "<think>{{ '\\n' }}{{ m.reasoning_content }}{{ '\\n' }}</think>{{ '\\n\\n' }}{% endif %}"
    "{{ m.content }}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)
TWO_QUESTIONS = [
    {"role": "user", "content": "What is 23*45?"},
    {"role": "assistant", "reasoning_content": "20*45 is 900, 3*45 is 135.", "content": "1035"},
    {"role": "user", "content": "And 2*3?"},
    {"role": "assistant", "reasoning_content": "two threes.", "content": "6"},
]


def test_a_template_that_drops_earlier_reasoning_trains_each_turn_as_generated(caplog):
    """Multi-turn reasoning rows under a Qwen3-style template used to fail ("does not render
    the messages before assistant message 3 as an extension"): the first turn's thinking is
    in the text only until the user speaks again. Now each assistant turn is its own example,
    after the history exactly as the template renders it when that turn is generated, with
    its own thinking in the loss; counted in a warning."""
    from tempering.models.generation.chat import render_chat

    tokenizer = make_tokenizer(DROPS_OLD_REASONING)
    with pytest.raises(ChatTemplateError, match="assistant message 3"):
        tokenize_message_log(TWO_QUESTIONS, tokenizer, 4096)  # one example: no cut exists
    with caplog.at_level("WARNING", logger="tempering.data.processing"):
        examples, _ = tokenize_message_logs([TWO_QUESTIONS, MESSAGES], tokenizer, 4096)
    assert "1 of 2 conversations became 2 examples, one per assistant turn" in caplog.text
    first, second, tools = examples
    assert _spans(tokenizer, first) == ["<think>\n20*45 is 900, 3*45 is 135.\n</think>\n\n1035"
                                        "<|im_end|>\n"]  # fmt: skip
    assert _spans(tokenizer, second) == ["<think>\ntwo threes.\n</think>\n\n6<|im_end|>\n"]
    context = [t for t, m in zip(second["input_ids"], second["token_mask"], strict=True) if not m]
    served = render_chat(tokenizer, tokenizer.chat_template, TWO_QUESTIONS[:3], None, True)
    assert context == tokenizer.encode(served, add_special_tokens=False)  # what inference shows
    assert "20*45" not in tokenizer.decode(context) and len(_spans(tokenizer, tools)) == 2
    # a row trained from its last turn on (a prompt/completion row) needs no split
    (only,), _ = tokenize_message_logs([Conversation(TWO_QUESTIONS, [], loss_from=3)],
                                       tokenizer, 4096)  # fmt: skip
    assert only == second
