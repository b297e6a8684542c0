"""Multi-turn rollouts on the real in-process vLLM engine (a bigram tiny Llama that writes tool
calls): the engine's log-probs of every sampled token of every turn equal transformers'
teacher-forced recomputation on the row's ids; TP = 2 ranks get the same rows and the tools
run on rank 0 only."""
import os

import numpy as np
import pytest
import torch

from agent_testlib import CALL, IM_END, PAD, build_bigram_llama, ids, teacher_forced_log_probs, word_tokenizer
from megaflow.protocol import DataProto
from megaflow.utils.launch import run_distributed

pytestmark = pytest.mark.slow

NUM_PROMPTS, N, RESPONSE_LEN = 4, 4, 48
OBS_3 = ids("<|im_start|>", "tool", "3", "<|im_end|>", "<|im_start|>", "assistant")


def _prompts() -> DataProto:
    raw = np.empty(NUM_PROMPTS, dtype=object)
    extra = np.empty(NUM_PROMPTS, dtype=object)
    for i in range(NUM_PROMPTS):
        raw[i] = [{"role": "user", "content": "what is 1+2 ?"}]
        extra[i] = {"tools_kwargs": {"calculator": {}}}
    env = np.array(["tool_agent" if i % 2 == 0 else "counted" for i in range(NUM_PROMPTS)], dtype=object)
    dummy = torch.ones(NUM_PROMPTS, 1, dtype=torch.long)
    return DataProto.from_dict({"input_ids": dummy, "attention_mask": dummy},
                               {"raw_prompt": raw, "extra_info": extra, "agent_name": env},
                               {"n": N, "temperature": 1.0, "seed": 5})


def _rollout(rank, world_size, model_dir, calls_path):
    import megaflow.agent as agent
    from megaflow.agent.loop import AgentLimits, tp_broadcaster
    from megaflow.agent.template import ChatRenderer
    from megaflow.agent.vllm_agent import generate_agent_sequences
    from megaflow.rollout.sampling import SamplingConfig
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    @agent.register_environment("counted")
    class Counted(agent.ToolEnvironment):  # the tool environment, logging the process of every call
        def step(self, calls):
            with open(calls_path, "a") as f:
                f.write(f"{os.getpid()}\n" * len(calls))
            return super().step(calls)

    rollout = VLLMRollout(VLLMRolloutConfig(model_dir, tp_size=world_size, kv_cache_bytes=32 << 20,
                                            max_model_len=256, max_num_seqs=16),
                          SamplingConfig(eos_token_ids=(IM_END,), pad_token_id=PAD, response_length=RESPONSE_LEN))
    tok = word_tokenizer()
    tool_rank = rank == 0
    out = generate_agent_sequences(
        rollout, _prompts(), ChatRenderer(tok, "<|im_end|>") if tool_rank else None,
        (lambda t: tok.decode(t)) if tool_rank else None, AgentLimits(max_turns=4, response_length=RESPONSE_LEN),
        is_tool_rank=tool_rank, broadcast=tp_broadcaster(None, src=0) if world_size > 1 else (lambda o: o))
    return {"pid": os.getpid(), "batch": out}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_bigram_llama(str(tmp_path_factory.mktemp("bigram")))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _check_rows(batch: DataProto, hf) -> None:
    b, nt = batch.batch, batch.non_tensor_batch
    assert len(batch) == NUM_PROMPTS * N
    turns = nt["agent_turns"].astype(np.int64)  # DataProto keeps non-tensor columns as object arrays
    assert (turns >= 2).sum() >= 3 and (turns == 1).sum() >= 1  # multi-turn and single-turn rows
    assert nt["agent_template_ok"].all()
    assert nt["agent_tool_errors"].sum() >= 1  # the bigram writes malformed calls too
    metrics = batch.meta_info["agent_metrics"]
    assert metrics["agent/turns/mean"] == pytest.approx(turns.mean()) and metrics["agent/template_mismatch"] == 0
    assert metrics["agent/tool_calls/mean"] == pytest.approx(nt["agent_tool_calls"].astype(np.int64).mean())
    assert all(text.startswith("[user]\nwhat is 1+2 ?") for text in nt["agent_text"])
    for i in range(len(batch)):
        prompt_len = int(b["attention_mask"][i, :b["prompts"].shape[1]].sum())
        length = int(b["attention_mask"][i].sum()) - prompt_len
        full = b["prompts"][i, -prompt_len:].tolist() + b["responses"][i, :length].tolist()
        mask = b["response_mask"][i, :length].bool()
        assert int((~mask).sum()) == int(nt["agent_observation_tokens"][i])
        expected = teacher_forced_log_probs(hf, full, prompt_len)
        assert torch.allclose(b["rollout_log_probs"][i, :length][mask], expected[mask], atol=1e-5)
        assert (b["rollout_log_probs"][i, :length][~mask] == 0).all()
        response = b["responses"][i, :length].tolist()
        call_turn = ids("<tool_call>", CALL, "</tool_call>", "<|im_end|>")
        if response[:4] == call_turn and nt["agent_name"][i] == "tool_agent":  # a well-formed first call: the template's observation follows
            assert response[4:10] == OBS_3


def _trainer_log_probs(rank, world_size, model_dir, tensors):
    """The trainer's recomputation: megaflow's MegatronEngine (t = 1) on the rollout rows."""
    from transformers import AutoConfig

    from megaflow.megatron import model as M
    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.models.weights import load_hf_weights
    from role_testlib import role_spec, seq_len_overrides

    cfg = AutoConfig.from_pretrained(model_dir)
    info = parallel.initialize_parallel(tp=1, pp=1, seed=1)
    gpt = M.build_gpt_model(cfg)
    load_hf_weights(gpt, model_dir, cfg, info)
    spec = role_spec("ref", ["resources.procs_per_node=1", "actor.tp=1", *seq_len_overrides(64, RESPONSE_LEN)],
                     hf_config=cfg)
    engine = MegatronEngine(gpt, info, spec, vocab_size=cfg.vocab_size)
    return engine.forward(tensors, temperature=1.0)["log_probs"]


def test_multi_turn_log_probs_equal_transformers_and_the_trainer(model, tmp_path):
    path, hf = model
    (res,) = run_distributed(_rollout, 1, path, str(tmp_path / "calls"), timeout_s=600)
    batch = res["batch"]
    _check_rows(batch, hf)
    tensors = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses",
                                           "response_mask")}
    (trainer,) = run_distributed(_trainer_log_probs, 1, path, tensors, timeout_s=600)
    mask = batch.batch["response_mask"].bool()
    assert mask.sum() > 0 and (~mask & batch.batch["attention_mask"][:, -RESPONSE_LEN:].bool()).sum() > 0
    torch.testing.assert_close(trainer[mask], batch.batch["rollout_log_probs"][mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("gen_tp,tied", [(2, False), (1, True)])
def test_trainer_log_probs_equal_the_engines_at_tg_and_tied(gen_tp, tied, tmp_path):
    """The trainer's recomputed log-probs of multi-turn rows equal the engine's within 1e-5
    (fp32) with the engine at t_g = 2 and with tied embeddings (t_g = 1 untied: the test above)."""
    from transformers import AutoModelForCausalLM

    path = build_bigram_llama(str(tmp_path / "model"), tied=tied)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == tied
    batch = run_distributed(_rollout, gen_tp, path, str(tmp_path / "calls"), timeout_s=600)[0]["batch"]
    _check_rows(batch, hf)
    tensors = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses",
                                           "response_mask")}
    (trainer,) = run_distributed(_trainer_log_probs, 1, path, tensors, timeout_s=600)
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(trainer[mask], batch.batch["rollout_log_probs"][mask], atol=1e-5, rtol=0)


def test_tp2_ranks_agree_and_tools_run_on_rank0_only(model, tmp_path):
    path, hf = model
    calls = tmp_path / "calls"
    res = run_distributed(_rollout, 2, path, str(calls), timeout_s=600)
    a, b = res[0]["batch"], res[1]["batch"]
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key]), key
    _check_rows(a, hf)
    pids = calls.read_text().split()
    counted_rows = [i for i in range(len(a)) if i // N % 2 == 1]
    assert set(pids) == {str(res[0]["pid"])}
    assert len(pids) == sum(int(a.non_tensor_batch["agent_tool_calls"][i]) for i in counted_rows) > 0
