"""Shared by the agent tests (importable from spawned ranks): a word-level ChatML tokenizer with a
tool role and a tiny Llama that is a bigram model over its vocabulary, so that a random-looking
sampler writes real tool calls."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

CALL = json.dumps({"name": "calculator", "arguments": {"expression": "1+2"}}, separators=(",", ":"))
BAD_CALL = '{"name":"calculator",'
WORDS = ["<pad>", "[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "tool", "tools:",
         "calculator", "python", "<tool_call>", "</tool_call>", CALL, BAD_CALL, "answer", "3", "what", "is", "1+2",
         "?", "think", "hard", "Error:", "malformed", "call:", "the", "has", "no", "closing"]
PAD, IM_END = 0, 3
# A ChatML template that renders tools and the tool role (as Qwen's does, in fewer words).
TEMPLATE = ("{%- if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
            "<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that drops the content of earlier assistant turns (as reasoning-stripping templates do).
STRIPPING_TEMPLATE = TEMPLATE.replace("{{ m.content }}", "{% if m.role == 'assistant' and not loop.last %}answer"
                                                         "{% else %}{{ m.content }}{% endif %}")
# A template without a tool role: tool messages are not rendered.
NO_TOOL_TEMPLATE = TEMPLATE.replace("{%- for m in messages %}", "{%- for m in messages if m.role != 'tool' %}")


def word_tokenizer(template: str = TEMPLATE):
    """A word-level tokenizer over WORDS (split on whitespace; im_start/im_end special)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                  unk_token="[UNK]", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    out.chat_template = template
    return out


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


# next-word probabilities of the bigram model (unlisted words -> <|im_end|>)
BIGRAM = {
    "assistant": {"<tool_call>": 0.5, "answer": 0.3, "think": 0.2},
    "think": {"hard": 0.6, "<tool_call>": 0.4},
    "hard": {"<tool_call>": 0.5, "answer": 0.5},
    "<tool_call>": {CALL: 0.8, BAD_CALL: 0.2},
    CALL: {"</tool_call>": 0.9, "<|im_end|>": 0.1},
    BAD_CALL: {"</tool_call>": 1.0},
    "</tool_call>": {"<|im_end|>": 1.0},
    "answer": {"3": 0.7, "<|im_end|>": 0.3},
}


def _bigram_logits() -> torch.Tensor:
    """``[V, V]``: row ``t`` the next-word logits after word ``t`` (log BIGRAM, -30 elsewhere; unlisted -> <|im_end|>)."""
    logits = torch.full((len(WORDS), len(WORDS)), -30.0)
    logits[:, IM_END] = 0.0
    for word, nxt in BIGRAM.items():
        logits[WORDS.index(word)] = -30.0
        for w, p in nxt.items():
            logits[WORDS.index(word), WORDS.index(w)] = math.log(p)
    return logits


def build_bigram_llama(path: str, tied: bool = False) -> str:
    """A 1-layer Llama whose next-token distribution depends on the current token only (BIGRAM).

    Untied: attention and MLP outputs are zero, so the last hidden state is the input token's
    embedding (one-hot) through the final RMSNorm: sqrt(hidden) * e_token; the LM head's
    column ``token`` holds the wanted logits / sqrt(hidden).

    Tied (the LM head is the embedding ``[I | 0]``): the MLP adds to the one-hot input a
    vector ``h_t - e_t`` with ``h_t[:V]`` = the logits shifted to >= 0 (softmax-invariant; -12
    for the unlisted words instead of -30) and one filler coordinate that makes
    ``rms(h_t) = 1``, so the final RMSNorm leaves ``h_t`` and the head reads the logits.
    (SiLU of the gate, ``silu(10 sqrt(hidden))``, is 1 x its input in fp32.)
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, v = (512 if tied else 128), len(WORDS)
    config = LlamaConfig(vocab_size=v, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=2, eos_token_id=IM_END, pad_token_id=PAD, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    layer = model.model.layers[0]
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :v] = torch.eye(v)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        if tied:
            shifted = _bigram_logits().clamp(min=-12.0) + 12.0  # [V, V] >= 0, |row|^2 < hidden
            target = torch.zeros(v, hidden)
            target[:, :v] = shifted
            target[:, v] = (hidden - (shifted ** 2).sum(-1)).sqrt()  # rms(target row) = 1
            x = math.sqrt(hidden)  # the MLP's input coordinate of the token (one-hot through RMSNorm)
            gate = 10.0
            layer.mlp.gate_proj.weight.zero_()
            layer.mlp.up_proj.weight.zero_()
            layer.mlp.gate_proj.weight[:v, :v] = gate * torch.eye(v)
            layer.mlp.up_proj.weight[:v, :v] = torch.eye(v)
            product = torch.nn.functional.silu(torch.tensor(gate * x)) * x
            layer.mlp.down_proj.weight[:, :v] = (target - torch.eye(v, hidden)).T / product
        else:
            head = torch.zeros(v, hidden)
            head[:, :v] = _bigram_logits().T / math.sqrt(hidden)
            model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    Path(path, "chat_template.jinja").write_text(TEMPLATE)
    return path


@torch.no_grad()
def teacher_forced_log_probs(model, full_ids: list[int], num_prompt: int) -> torch.Tensor:
    """log p(token_t | tokens_<t) of every response position of ``full_ids`` (fp32, transformers)."""
    x = torch.tensor([full_ids])
    logits = model(input_ids=x).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None])[:, 0]
    return lp[num_prompt - 1:]
