"""Vocab-parallel log-probs/entropy against a full-vocabulary torch reference (one process).

The TP = 2 / 4 cases run inside the multi-process engine tests (test_engine_parity.py).
"""
from __future__ import annotations

import pytest
import torch

from megaflow.megatron.logprobs import vocab_parallel_log_probs


def _reference(logits, labels, vocab, temperature):
    z = logits[..., :vocab].double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_full_softmax(temperature):
    g = torch.Generator().manual_seed(0)
    vocab, padded = 37, 48  # 11 padding ids must get no probability
    logits = (torch.randn(3, 5, padded, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, vocab, (3, 5), generator=g)
    w_lp, w_h = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)

    lp, ent = vocab_parallel_log_probs(logits, labels, tp_group=None, vocab_size=vocab,
                                       temperature=temperature, with_entropy=True)
    (lp * w_lp + ent * w_h).sum().backward()
    ours = logits.grad.clone()

    ref_logits = logits.detach().double().requires_grad_()
    ref_lp, ref_h = _reference(ref_logits, labels, vocab, temperature)
    (ref_lp * w_lp + ref_h * w_h).sum().backward()

    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_h, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.double(), ref_logits.grad, atol=1e-5, rtol=0)
    assert torch.all(ours[..., vocab:] == 0)  # padding receives no gradient


def test_log_probs_only_gradient_and_no_entropy():
    logits = torch.randn(4, 10, requires_grad=True)
    labels = torch.tensor([0, 3, 9, 9])
    lp, ent = vocab_parallel_log_probs(logits, labels, tp_group=None)
    assert ent is None
    lp.sum().backward()
    p = torch.softmax(logits.detach(), -1)
    expected = torch.nn.functional.one_hot(labels, 10).float() - p
    torch.testing.assert_close(logits.grad, expected)


def test_bad_input():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), tp_group=None,
                                 temperature=0.0)
    with pytest.raises(ValueError, match="leading"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), tp_group=None)
