"""The tiny agent task: two-digit sums a tiny model can only get right by calling the calculator.

A prompt is ``"<user>47+85=<eos><assistant>"``; the tool-using answer is two assistant turns::

    <assistant><call>47+85<end_call><eos><tool>132<eos><assistant>132<eos>

where ``<call>`` / ``<end_call>`` are single tokens that decode to the Hermes/Qwen call text
``<tool_call>{"name": "calculator", "arguments": {"expression": "`` and ``"}}</tool_call>``
(:mod:`megaflow.agent.parser` reads it; the calculator answers ``132``). With operands from
10 to 99 there are 8,100 problems: a 2-layer model from random initialisation does not learn
two-digit addition in minutes, but copying the operands into a call and the observation into
the answer is within its reach. The reward (:mod:`megaflow.rewards.tool_arith`) grades the
final answer and the call.

The tokenizer (:func:`build_tool_arith_tokenizer`) is a ``transformers`` fast tokenizer of
18 tokens: the character-level digits, ``+`` and ``=``, the role tokens, the two call tokens
and ``<error>``, the unknown token, to which the whole text of an error observation
(``"Error: ..."``: a malformed call, an expression the calculator refuses) encodes, so an error
costs one observation token. Its chat template ends every message with ``<eos>`` (ChatML's
shape, as :class:`~megaflow.agent.template.ChatRenderer` needs), renders the tool role and
ignores the tool specs (the call tokens are the model's whole interface to the calculator).

Rows (``data_source="tool_arith"``) name the calculator in ``extra_info.tools_kwargs`` (verl's
multi-turn layout); the problems are :class:`~megaflow.data.arith.ArithTaskConfig`'s.
"""
from __future__ import annotations

from typing import Any

from megaflow.data.arith import arith_answer

TOOL_ARITH_DATA_SOURCE = "tool_arith"
EOS_TOKEN, UNK_TOKEN = "<eos>", "<error>"
ROLE_TOKENS = ("<user>", "<assistant>", "<tool>")
CALL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'
#: Token ids: <eos>=0 (also pad), roles 1-3, <error>=4, the call tokens 5-6, "0".."9"=7..16, "+"=17, "="=18.
TOOL_ARITH_VOCAB: tuple[str, ...] = (EOS_TOKEN, *ROLE_TOKENS, UNK_TOKEN, CALL_OPEN, CALL_CLOSE, *"0123456789", "+",
                                     "=")
TOOL_ARITH_CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<assistant>{% elif m.role == 'tool' %}<tool>{% else %}<user>{% endif %}"
    "{{ m.content }}<eos>{% endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}")


def build_tool_arith_tokenizer():
    """The task's tokenizer (module docstring): ``vocab_size == 19``, ``pad == eos == "<eos>"`` (id 0).

    ``encode`` adds no special tokens; the role, call, EOS and ``<error>`` tokens are matched
    whole in any text (so every decoded sample encodes back to its ids), every other character
    is one token, and an ``"Error: ..."`` text up to the next special token is the single
    unknown token ``<error>``. Built in-process (no files).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TOOL_ARITH_VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"Error:[\s\S]*|[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    specials = [EOS_TOKEN, *ROLE_TOKENS, UNK_TOKEN, CALL_OPEN, CALL_CLOSE]  # matched whole: decode round-trips
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                        unk_token=UNK_TOKEN, padding_side="left", model_max_length=64)
    tokenizer.chat_template = TOOL_ARITH_CHAT_TEMPLATE
    return tokenizer


def make_tool_arith_row(a: int, op: str, b: int, *, split: str, index: int) -> dict[str, Any]:
    """One verl multi-turn row for ``a op b``: the calculator in ``extra_info.tools_kwargs``."""
    return {
        "data_source": TOOL_ARITH_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(arith_answer(a, op, b))},
        "extra_info": {"split": split, "index": index, "a": a, "b": b, "op": op,
                       "tools_kwargs": {"calculator": {"create_kwargs": {}}}},
    }


__all__ = ["CALL_CLOSE", "CALL_OPEN", "TOOL_ARITH_CHAT_TEMPLATE", "TOOL_ARITH_DATA_SOURCE", "TOOL_ARITH_VOCAB",
           "build_tool_arith_tokenizer", "make_tool_arith_row"]
