"""ChatRenderer: observation ids from the template's tool role, refusals at load, and the
whole-conversation check on a real BPE tokenizer (SmolLM2's)."""
import pytest

from agent_testlib import NO_TOOL_TEMPLATE, STRIPPING_TEMPLATE, TEMPLATE, ids, word_tokenizer
from megaflow.agent import Calculator
from megaflow.agent.template import ChatRenderer


def test_observation_is_what_the_template_renders_after_the_turn_end():
    renderer = ChatRenderer(word_tokenizer(), "<|im_end|>")
    assert renderer.appends
    text = renderer.observation_text([("calculator", "3"), ("python", "hard")])
    assert text == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>tool\nhard<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.observation_ids([("calculator", "3")]) == ids("<|im_start|>", "tool", "3", "<|im_end|>",
                                                                  "<|im_start|>", "assistant")


def test_refusals_at_load():
    with pytest.raises(ValueError, match="no tool role"):
        ChatRenderer(word_tokenizer(NO_TOOL_TEMPLATE), "<|im_end|>")
    with pytest.raises(ValueError, match="does not end an assistant turn with '</s>'"):
        ChatRenderer(word_tokenizer(), "</s>")
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(word_tokenizer(""), "<|im_end|>")
    assert not ChatRenderer(word_tokenizer(STRIPPING_TEMPLATE), "<|im_end|>").appends


@pytest.mark.slow  # builds SmolLM2 into the user cache on first use
def test_matches_template_on_smollm2_bpe():
    from transformers import AutoTokenizer

    from megaflow.models.smollm2 import ensure_smollm2

    tok = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    renderer = ChatRenderer(tok, "<|im_end|>")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    messages, tools = [{"role": "user", "content": "What is 12*7?"}], [Calculator().spec()]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
    sampled = [tok.encode(call, add_special_tokens=False) + [end],
               tok.encode("The answer is 84.", add_special_tokens=False) + [end]]
    full = (renderer.prompt_ids(messages, tools) + sampled[0] + renderer.observation_ids([("calculator", "84")])
            + sampled[1])
    conversation = messages + [{"role": "assistant", "content": call},
                               {"role": "tool", "name": "calculator", "content": "84"},
                               {"role": "assistant", "content": "The answer is 84."}]
    assert renderer.matches_template(conversation, tools, full)
    # the same text sampled as a tokenisation the template would not produce (" answer" as
    # " ans" + "wer") is caught: the ids differ from the template's, though the text is equal
    split = tok.encode("The", add_special_tokens=False) + tok.convert_tokens_to_ids(["Ġans", "wer"]) + tok.encode(
        " is 84.", add_special_tokens=False) + [end]
    assert tok.decode(split) == tok.decode(sampled[1]) and split != sampled[1]
    assert not renderer.matches_template(conversation, tools, full[:-len(sampled[1])] + split)
