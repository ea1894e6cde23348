"""Chat prompts as token ids (tempering/models/generation/chat.py): end-of-turn detection, the
on-policy splice, non-contiguous history, tools, Hermes and Llama 3 JSON tool-call parsing.
Tokenizers are tiny-arith's (EOS ends assistant turns) and a ChatML variant of it whose
end-of-turn token ``<|im_end|>`` is not the EOS, as in SmolLM2 or Qwen."""

from __future__ import annotations

import json

import pytest

from tempering.models.generation.chat import (
    ChatPromptBuilder,
    NonContiguousHistoryError,
    parse_hermes_tool_calls,
    parse_llama3_json_tool_calls,
    parse_mistral_tool_calls,
)
from tempering.models.tiny_arith import build_tokenizer

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Renders an earlier assistant turn without its reasoning once more turns follow (as Qwen3's does).
STRIPS_REASONING = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ message['content'].split('</think>')[-1] }}{% else %}{{ message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tiny():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chatml():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_end_of_turn_token_is_found_from_the_template(tiny, chatml):
    assert ChatPromptBuilder(tiny).eot_token == "<eos>"
    builder = ChatPromptBuilder(chatml)
    assert builder.eot_token == "<|im_end|>"
    assert builder.eot_token_id != chatml.eos_token_id  # not the EOS: found, not assumed


def test_a_base_models_tokenizer_ends_turns_at_eos_and_refuses_messages_by_name():
    """No chat template (a base model): prompts arrive as token ids, so the builder stands;
    a turn ends at the EOS; rendering messages is refused with the fix."""
    base = build_tokenizer()
    base.chat_template = None
    builder = ChatPromptBuilder(base)
    assert (builder.eot_token, builder.eot_token_id) == (base.eos_token, base.eos_token_id)
    with pytest.raises(ValueError, match="no chat template .*policy.tokenizer.chat_template"):
        builder.encode([_user("1+1=?")])


def test_first_turn_is_the_template_rendering(chatml):
    builder = ChatPromptBuilder(chatml)
    enc = builder.encode([_user("Q: 1+2=? A:")])
    text = chatml.apply_chat_template(
        [_user("Q: 1+2=? A:")], tokenize=False, add_generation_prompt=True
    )
    assert enc.ids == chatml(text, add_special_tokens=False)["input_ids"] and not enc.spliced


def test_next_turn_is_the_earlier_ids_plus_the_template_tail(chatml):
    builder = ChatPromptBuilder(chatml)
    first = builder.encode([_user("Q: 23+45=? A:")]).ids
    # What the model sampled: "=?" as two tokens, then <|im_end|>. Re-encoding the decoded text
    # gives other ids (the BPE has a merged "=?" token): the off-policy trap the splice avoids.
    sampled = [chatml.convert_tokens_to_ids(t) for t in ["=", "?"]] + [builder.eot_token_id]
    text = chatml.decode(sampled, skip_special_tokens=True)
    assert builder.encode_text(text) + [builder.eot_token_id] != sampled
    messages = [
        _user("Q: 23+45=? A:"),
        {"role": "assistant", "content": text, "prompt_token_ids": first,
         "generation_token_ids": sampled},
        {"role": "tool", "content": "68"},
    ]  # fmt: skip
    enc = builder.encode(messages)
    assert enc.spliced
    assert enc.ids[: len(first) + len(sampled)] == first + sampled
    tail = chatml.decode(enc.ids[len(first) + len(sampled) :])
    assert (
        tail
        == "\n<|im_start|>tool\n<tool_response>\n68\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_turn_cut_off_before_its_end_gets_the_end_of_turn_token(tiny):
    builder = ChatPromptBuilder(tiny)
    first = builder.encode([_user("Q: 1+2=? A:")]).ids
    cut = builder.encode_text(" 3")  # finish_reason "length": no EOS generated
    messages = [
        _user("Q: 1+2=? A:"),
        {"role": "assistant", "content": " 3", "prompt_token_ids": first,
         "generation_token_ids": cut},
        _user("Q: 2+2=? A:"),
    ]  # fmt: skip
    ids = builder.encode(messages).ids
    n = len(first) + len(cut)
    assert ids[:n] == first + cut and ids[n] == tiny.eos_token_id
    assert ids[n + 1 :] == builder.encode_text("Q: 2+2=? A:")


def _two_turns(builder, tok):
    first = builder.encode([_user("Q: 1+2=? A:")]).ids
    gen1 = builder.encode_text(" 3") + [builder.eot_token_id]
    second = builder.encode(
        [_user("Q: 1+2=? A:"), _assistant(" 3", first, gen1), _user("Q: 2+2=? A:")]
    ).ids
    gen2 = builder.encode_text(" 4") + [builder.eot_token_id]
    return first, gen1, second, gen2


def _assistant(text, prompt_ids, gen_ids):
    return {"role": "assistant", "content": text, "prompt_token_ids": prompt_ids,
            "generation_token_ids": gen_ids}  # fmt: skip


def test_rewritten_history_is_refused_or_truncated_and_counted(tiny):
    builder = ChatPromptBuilder(tiny)
    first, gen1, second, gen2 = _two_turns(builder, tiny)
    forged = [*first[:-1], first[-1] + 1]  # turn 2's prompt no longer extends turn 1
    messages = [
        _user("Q: 1+2=? A:"),
        _assistant(" 3", first, gen1),
        _user("Q: 2+2=? A:"),
        _assistant(" 4", forged + second[len(first) :], gen2),
        _user("Q: 3+3=? A:"),
    ]
    with pytest.raises(NonContiguousHistoryError, match="not a prefix"):
        builder.encode(messages)
    enc = builder.encode(messages, on_noncontiguous="truncate")
    assert enc.truncated and enc.spliced
    # fell back to turn 1, the last contiguous one; turn 2's text is re-encoded and counted
    assert enc.ids[: len(first) + len(gen1)] == first + gen1
    assert enc.retokenized_assistant_turns == 1


def test_a_template_that_rewrites_earlier_turns_is_noncontiguous(tiny):
    builder = ChatPromptBuilder(tiny, chat_template=STRIPS_REASONING)
    first = builder.encode([_user("Q: 1+2=? A:")]).ids
    gen = builder.encode_text("<think>1+2</think> 3") + [tiny.eos_token_id]
    messages = [_user("Q: 1+2=? A:"), _assistant("<think>1+2</think> 3", first, gen), _user("Q:")]
    with pytest.raises(NonContiguousHistoryError, match="renders"):
        builder.encode(messages)


def test_history_without_ids_is_rendered_and_counted(tiny):
    builder = ChatPromptBuilder(tiny)
    messages = [_user("Q: 1+2=? A:"), {"role": "assistant", "content": " 3"}, _user("Q:")]
    enc = builder.encode(messages)
    assert not enc.spliced and enc.retokenized_assistant_turns == 1
    assert enc.ids == builder.encode_text("Q: 1+2=? A: 3<eos>Q:")


def test_tools_get_a_default_prompt_when_the_template_ignores_them(chatml):
    builder = ChatPromptBuilder(chatml)
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
    text = builder.render([_user("hi")], tools=[tool])
    assert text.startswith("<|im_start|>system\nYou can call these tools")
    assert '"name": "calculator"' in text and "<tool_call>" in text


def test_tool_calls_in_history_render_as_hermes_blocks(chatml):
    builder = ChatPromptBuilder(chatml)
    call = {"id": "c1", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}  # fmt: skip
    text = builder.render(
        [_user("2*3?"), {"role": "assistant", "content": None, "tool_calls": [call]}],
        add_generation_prompt=False,
    )
    block = text.split("<tool_call>\n")[1].split("\n</tool_call>")[0]
    assert json.loads(block) == {"name": "calculator", "arguments": {"expression": "2*3"}}


def test_hermes_parser_keeps_bad_blocks_in_the_content():
    parsed = parse_hermes_tool_calls(
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
        "</tool_call><tool_call>{not json}</tool_call>"
    )
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["calculator"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"expression": "1+2"}
    assert parsed.content == "Let me compute. <tool_call>{not json}</tool_call>"
    assert len(parsed.errors) == 1 and "unparseable" in parsed.errors[0]


def test_hermes_parser_reports_an_unclosed_block_and_plain_text_passes():
    cut = parse_hermes_tool_calls('<tool_call>{"name": "calc')
    assert cut.tool_calls == [] and cut.content == '<tool_call>{"name": "calc'
    assert "no closing" in cut.errors[0]
    plain = parse_hermes_tool_calls(" 42")
    assert plain.content == " 42" and plain.tool_calls == [] and plain.errors == []


def test_llama3_json_parser_reads_one_or_several_calls():
    one = parse_llama3_json_tool_calls(
        '{"name": "calculator", "parameters": {"expression": "1+2"}}'
    )
    assert one.content is None and one.errors == []
    assert one.tool_calls[0]["function"]["name"] == "calculator"
    assert json.loads(one.tool_calls[0]["function"]["arguments"]) == {"expression": "1+2"}
    two = parse_llama3_json_tool_calls(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
    )
    assert [c["function"]["name"] for c in two.tool_calls] == ["a", "b"]
    assert json.loads(two.tool_calls[1]["function"]["arguments"]) == {"x": 1}


def test_llama3_json_parser_keeps_plain_and_bad_replies_as_content():
    plain = parse_llama3_json_tool_calls(" 42")
    assert plain.content == " 42" and plain.tool_calls == [] and plain.errors == []
    bad_replies = ('{"name": "calc', '{"parameters": {}}', '{"name": "a", "parameters": {}} then',
                   '{"name": "a", "parameters": [1]}')  # fmt: skip
    for bad in bad_replies:
        parsed = parse_llama3_json_tool_calls(bad)
        assert parsed.tool_calls == [] and parsed.content == bad, bad
        assert len(parsed.errors) == 1 and "unparseable" in parsed.errors[0], bad


def test_mistral_parser_reads_both_call_formats_after_the_token():
    v7 = parse_mistral_tool_calls(
        'Let me check.[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1+2"}},'
        ' {"name": "clock", "arguments": {}}]'
    )
    assert v7.content == "Let me check." and v7.errors == []
    assert [c["function"]["name"] for c in v7.tool_calls] == ["calculator", "clock"]
    assert json.loads(v7.tool_calls[0]["function"]["arguments"]) == {"expression": "1+2"}
    v11 = parse_mistral_tool_calls('[TOOL_CALLS]calculator[ARGS]{"expression": "2*3"}'
                                   '[TOOL_CALLS]clock[ARGS]{}')  # fmt: skip
    assert v11.content is None and [c["function"]["name"] for c in v11.tool_calls] == [
        "calculator", "clock"]  # fmt: skip
    assert json.loads(v11.tool_calls[0]["function"]["arguments"]) == {"expression": "2*3"}


def test_mistral_parser_keeps_plain_and_bad_replies_as_content():
    plain = parse_mistral_tool_calls(" 42")
    assert plain.content == " 42" and plain.tool_calls == [] and plain.errors == []
    for bad in ('[TOOL_CALLS][{"name": "calc"', '[TOOL_CALLS][{"arguments": {}}]',
                '[TOOL_CALLS]calc[ARGS]{"x": ', '[TOOL_CALLS][{"name": "a", "arguments": [1]}]'):  # fmt: skip
        parsed = parse_mistral_tool_calls(bad)
        assert parsed.tool_calls == [] and parsed.content == bad, bad
        assert len(parsed.errors) == 1 and "unparseable" in parsed.errors[0], bad


def test_auto_tool_parser_follows_the_model_family_of_the_template(chatml):
    from tempering.models.families import build_tokenizer

    llama3 = ChatPromptBuilder(build_tokenizer("llama3"), tool_parser="auto")
    assert llama3.tool_parser == "llama3_json"
    assert llama3.parse_tool_calls('{"name": "f", "parameters": {}}').tool_calls
    assert ChatPromptBuilder(chatml, tool_parser="auto").tool_parser == "hermes"  # ChatML: Qwen
    assert ChatPromptBuilder(build_tokenizer("qwen3"), tool_parser="auto").tool_parser == "hermes"
    mistral = ChatPromptBuilder(build_tokenizer("mistral"), tool_parser="auto")
    assert mistral.tool_parser == "mistral"
    assert mistral.parse_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}]').tool_calls
    # Our Llama 3 template does not render `tools`, and the default prompt teaches Hermes.
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
    with pytest.raises(ValueError, match="llama3_json"):
        llama3.render([_user("hi")], tools=[tool])
