"""Log-probs under top-k/top-p truncation (``rollout.logprobs_mode=processed``).

* the kept set equals vLLM 0.32's own filter (``apply_top_k_top_p_pytorch``, the CPU sampler's)
  on random logits, ties at the k-th value included;
* values and gradients equal a float64 ``log_softmax`` over the kept tokens; a label outside
  them gets the documented floor and no gradient;
* vocabulary-parallel over TP: tp = 2 (two gloo ranks, each holding half the vocabulary and
  exchanging only candidates) equals tp = 1;
* the default (top_p = 1, top_k = -1) is the untruncated computation, bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.megatron.logprobs import OUTSIDE_SUPPORT_LOG_PROB, truncation_mask, vocab_parallel_log_probs
from megaflow.utils.launch import run_distributed

CASES = [(0.6, 20), (0.6, -1), (1.0, 5), (0.9, 3), (0.05, -1)]


def _vllm_removed(z: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    rows = z.shape[0]
    k = torch.full((rows,), top_k) if top_k > 0 else None
    p = torch.full((rows,), top_p) if top_p < 1 else None
    return apply_top_k_top_p_pytorch(z.detach().clone(), k, p) == float("-inf")


@pytest.mark.parametrize("top_p,top_k", CASES)
def test_kept_set_is_vllms(top_p, top_k):
    g = torch.Generator().manual_seed(7)
    for scale in (0.3, 1.0, 4.0):
        z = torch.randn(64, 250, generator=g) * scale
        assert torch.equal(truncation_mask(z, top_p=top_p, top_k=top_k), _vllm_removed(z, top_p, top_k))
        z[:4, :30] = z[:4, :1]  # a tie group of 30 around the k-th value / across the nucleus boundary
        ours, vllm = truncation_mask(z, top_p=top_p, top_k=top_k), _vllm_removed(z, top_p, top_k)
        if top_p == 1.0:  # top-k: ties with the k-th value are all kept, as vLLM does
            assert torch.equal(ours, vllm)
        else:  # top-p: the whole tie group is kept (vLLM's unstable sort cuts it somewhere)
            assert torch.equal(ours[4:], vllm[4:]) and not (ours & ~vllm).any()


def _reference(logits, labels, vocab, temperature, top_p, top_k):
    """float64 log_softmax over the tokens vLLM keeps; entropy of that distribution."""
    z = logits[..., :vocab].double() / temperature
    flat = z.reshape(-1, vocab)
    removed = _vllm_removed(flat.float(), top_p, top_k).view(z.shape)
    logp = torch.log_softmax(z.masked_fill(removed, float("-inf")), dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp.masked_fill(removed, 0.0)).sum(-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("top_p,top_k", CASES)
def test_values_and_gradients_match_the_truncated_softmax(top_p, top_k):
    g = torch.Generator().manual_seed(0)
    vocab, padded, temperature = 37, 48, 0.8
    logits = (torch.randn(3, 5, padded, generator=g) * 3).requires_grad_()
    # labels inside the kept set: the most likely token of each position
    labels = logits.detach()[..., :vocab].argmax(-1)
    w_lp, w_h = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    lp, ent = vocab_parallel_log_probs(logits, labels, tp_group=None, vocab_size=vocab, temperature=temperature,
                                       top_p=top_p, top_k=top_k, with_entropy=True)
    (lp * w_lp + ent * w_h).sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref_lp, ref_h = _reference(ref_logits, labels, vocab, temperature, top_p, top_k)
    (ref_lp * w_lp + ref_h * w_h).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_h, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-5, rtol=0)
    untruncated, _ = vocab_parallel_log_probs(logits.detach(), labels, tp_group=None, vocab_size=vocab,
                                              temperature=temperature)
    gap = lp.detach() - untruncated  # minus the log of the kept mass: > 0 wherever something is removed
    assert gap.min() > 1e-5 and gap.max() > 1e-2


def test_label_outside_the_kept_set_gets_the_floor_and_no_gradient():
    assert OUTSIDE_SUPPORT_LOG_PROB == pytest.approx(math.log(torch.finfo(torch.float32).tiny))
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]], requires_grad=True)
    lp, ent = vocab_parallel_log_probs(logits, torch.tensor([3]), tp_group=None, top_k=2, with_entropy=True)
    assert lp.item() == pytest.approx(OUTSIDE_SUPPORT_LOG_PROB)
    lp.sum().backward()
    assert torch.all(logits.grad == 0)
    p = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    assert ent.item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)


def test_default_is_the_untruncated_computation_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    logits, labels = torch.randn(6, 40, generator=g), torch.randint(0, 40, (6,), generator=g)
    lp, ent = vocab_parallel_log_probs(logits, labels, tp_group=None, temperature=0.7, with_entropy=True)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref)
    same, same_ent = vocab_parallel_log_probs(logits, labels, tp_group=None, temperature=0.7, top_p=1.0,
                                              top_k=-1, with_entropy=True)
    assert torch.equal(lp, same) and torch.equal(ent, same_ent)


def test_bad_top_p():
    with pytest.raises(ValueError, match="top_p"):
        vocab_parallel_log_probs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), tp_group=None, top_p=0.0)


def _inputs():
    g = torch.Generator().manual_seed(11)
    vocab, padded = 250, 256
    logits = torch.randn(40, padded, generator=g) * 2.5
    labels = torch.randint(0, vocab, (40,), generator=g)
    return logits, labels, vocab


def _tp_rank(rank, world_size, top_p, top_k):
    import torch.distributed as dist

    logits, labels, vocab = _inputs()
    shard = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    group = dist.new_group(list(range(world_size)))
    lp, ent = vocab_parallel_log_probs(shard, labels, tp_group=group, vocab_size=vocab, temperature=0.9,
                                       top_p=top_p, top_k=top_k, with_entropy=True)
    (lp.clamp_min(-50) + 0.5 * ent).sum().backward()
    removed = truncation_mask(shard.detach() / 0.9, top_p=top_p, top_k=top_k, tp_group=group, vocab_size=vocab)
    return lp.detach(), ent.detach(), shard.grad, removed


@pytest.mark.slow
@pytest.mark.parametrize("top_p,top_k", [(0.6, 20), (0.8, -1), (1.0, 7)])
def test_tp2_equals_tp1(top_p, top_k):
    one = run_distributed(_tp_rank, 1, top_p, top_k)[0]
    two = run_distributed(_tp_rank, 2, top_p, top_k)
    for i in (0, 1):  # log-probs and entropy are replicated over the TP ranks
        torch.testing.assert_close(two[0][i], one[i], atol=1e-5, rtol=0)  # fp32 sums in another order
        torch.testing.assert_close(two[1][i], one[i], atol=1e-5, rtol=0)
    for i in (2, 3):  # gradient and mask: each rank's vocabulary half
        torch.testing.assert_close(torch.cat([two[0][i], two[1][i]], dim=-1), one[i], atol=1e-5, rtol=0)
    assert one[3].any() and not one[3][:, :250].all(dim=-1).any()  # some removed, never all
    assert (one[0] == OUTSIDE_SUPPORT_LOG_PROB).any() or top_k < 0  # random labels fall outside


def test_chunked_projection_truncates_the_same_way():
    from megaflow.megatron.logprobs import chunked_vocab_parallel_log_probs

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 7, 16, generator=g).requires_grad_()
    weight = torch.randn(48, 16, generator=g)
    labels = (hidden.detach() @ weight.t())[..., :40].argmax(-1)
    kw = dict(tp_group=None, vocab_size=40, temperature=0.8, top_p=0.6, top_k=20, with_entropy=True)
    whole_lp, whole_h = vocab_parallel_log_probs(hidden @ weight.t(), labels, **kw)
    (whole_lp + whole_h).sum().backward()
    whole_grad, hidden.grad = hidden.grad.clone(), None
    lp, h = chunked_vocab_parallel_log_probs(hidden, weight, labels, chunk_tokens=4, **kw)
    (lp + h).sum().backward()
    torch.testing.assert_close(lp, whole_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(h, whole_h, atol=1e-6, rtol=0)
    torch.testing.assert_close(hidden.grad, whole_grad, atol=1e-5, rtol=0)
