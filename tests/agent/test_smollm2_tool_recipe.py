"""The SmolLM2 agent recipe (recipes/smollm2_gsm8k_tool_grpo.yaml): GSM8K rows with the
calculator described in a system message (SmolLM2's template ignores ``tools=[...]``), written
by ``tools/prepare_gsm8k.py --tools``, and two GRPO steps of the recipe on CPU."""
import json
import math
import os
import sys
from pathlib import Path

import pytest

from megaflow.agent import Calculator, ToolCall, check_rows, parse_tool_calls
from megaflow.agent.system_prompt import tool_system_prompt, with_tool_system_prompt
from megaflow.data.io import read_rows
from megaflow.topology import load_run
from megaflow.trainer.main import run_dir_of, train
from megaflow.utils.tracking import read_metrics_jsonl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from toolslib import load_tool

RECIPE = "smollm2_gsm8k_tool_grpo"
QUESTION = {"question": "Tom has 3 bags of 7 apples. How many apples?", "answer": "3 * 7 = 21\n#### 21"}


def test_system_prompt_lists_the_specs_and_shows_a_call_the_parser_reads():
    text = tool_system_prompt(["calculator", "python"])
    tools_block = text[text.index("<tools>\n") + len("<tools>\n"):text.index("\n</tools>")]
    from megaflow.agent.registry import make_tool
    assert [json.loads(line) for line in tools_block.splitlines()] == \
        [make_tool("calculator").spec(), make_tool("python").spec()]
    calls = parse_tool_calls(text[text.index("</tools>"):])
    assert calls == [ToolCall("calculator", {"expression": "(12 + 7) * 3"})]
    assert Calculator().call(calls[0].arguments) == "57"  # 19 * 3: the example is a working call
    with pytest.raises(ValueError, match="unknown tool 'calc'"):
        tool_system_prompt(["calc"])
    with pytest.raises(ValueError, match="at least one"):
        tool_system_prompt([])


def test_tool_row_replaces_the_system_message_and_names_the_tools():
    row = {"data_source": "openai/gsm8k", "extra_info": {"index": 3},
           "prompt": [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}]}
    out = with_tool_system_prompt(row, ["calculator"], "SYS")
    assert out["prompt"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "q"}]
    assert out["extra_info"] == {"index": 3, "tools_kwargs": {"calculator": {"create_kwargs": {}}}}
    assert row["prompt"][0]["content"] == "old" and "tools_kwargs" not in row["extra_info"]  # not changed
    check_rows([out])


def _gsm8k_src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text(json.dumps(QUESTION) + "\n")
    return src


def test_prepare_gsm8k_writes_tool_rows(tmp_path, capsys):
    prepare = load_tool("prepare_gsm8k")
    src = _gsm8k_src(tmp_path)
    assert prepare.main(["--src", str(src), "--out", str(tmp_path / "out"), "--tools", "calculator"]) == 0
    rows = [row for _, row in read_rows(tmp_path / "out" / "train.jsonl")]
    assert len(rows) == 1 and rows[0]["reward_model"]["ground_truth"] == "21"
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"]
    assert rows[0]["prompt"][0]["content"] == tool_system_prompt(["calculator"])
    assert rows[0]["prompt"][1]["content"].startswith(QUESTION["question"])
    assert rows[0]["extra_info"]["tools_kwargs"] == {"calculator": {"create_kwargs": {}}}
    # without --tools: the single-turn rows, unchanged
    assert prepare.main(["--src", str(src), "--out", str(tmp_path / "plain")]) == 0
    plain = [row for _, row in read_rows(tmp_path / "plain" / "train.parquet")]
    assert [m["role"] for m in plain[0]["prompt"]] == ["user"] and "tools_kwargs" not in plain[0]["extra_info"]
    # bad input: one line, exit 2, nothing written
    assert prepare.main(["--src", str(src), "--out", str(tmp_path / "bad"), "--tools", "calc"]) == 2
    assert "unknown tool 'calc'" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit) as exc:
        prepare.main(["--src", str(src), "--out", str(tmp_path / "bad"), "--tools", "calculator",
                      "--format", "parquet"])
    assert exc.value.code == 2 and "--tools writes JSONL" in capsys.readouterr().err


def test_recipe_is_the_agent_twin_of_the_gpu_recipe():
    """Same model, sizes, optimizer, KL loss and reward as smollm2_gsm8k_grpo; the agent loop
    on the tool rows that ``tools/prepare_gsm8k.py --out data/gsm8k_tool --tools calculator`` writes."""
    cfg, base = load_run(RECIPE), load_run("smollm2_gsm8k_grpo")
    assert cfg.rollout.agent.enabled and not base.rollout.agent.enabled
    assert cfg.data.train_files == ("data/gsm8k_tool/train.jsonl",)
    assert cfg.data.val_files == ("data/gsm8k_tool/test.jsonl",)
    for section in ("model", "algorithm", "actor", "ref", "reward", "resources"):
        assert getattr(cfg, section) == getattr(base, section), section
    assert (cfg.rollout.n, cfg.data.train_batch_size) == (base.rollout.n, base.data.train_batch_size)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_tool_recipe_runs_two_steps(ray_session, tmp_path):
    """Two steps of the recipe on CPU, cut to 2 prompts x 2 trajectories of at most 48 tokens
    (all turns), on the first 8 problems of each split of the project's GSM8K written by
    ``tools/prepare_gsm8k.py --tools calculator`` (the load-time agent checks render every
    row); no validation."""
    from megaflow.data.gsm8k_layout import GSM8K_DEFAULT_DIR, GSM8K_SPLITS
    from megaflow.models.smollm2 import ensure_smollm2

    src = tmp_path / "src"
    src.mkdir()
    for split in GSM8K_SPLITS:
        lines = (GSM8K_DEFAULT_DIR / f"{split}.jsonl").read_text().splitlines()[:8]
        (src / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "gsm8k_tool"
    assert load_tool("prepare_gsm8k").main(["--src", str(src), "--out", str(out), "--tools", "calculator"]) == 0
    data = {split: out / f"{split}.jsonl" for split in GSM8K_SPLITS}
    cfg = load_run(RECIPE, [
        f"model.path={ensure_smollm2()}", f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.response_length=48",
        "rollout.cpu_kv_cache_gib=1", "trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=-1",
        "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path}"])
    assert cfg.rollout.agent.enabled and cfg.algorithm.use_kl_loss and cfg.ref.enabled
    train(cfg)
    rows = read_metrics_jsonl(run_dir_of(cfg) / "metrics.jsonl")
    assert [int(r["step"]) for r in rows] == [1, 2]
    for m in rows:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics at step {m['step']}: {bad}"
        assert 1 <= m["agent/turns/mean"] <= cfg.rollout.agent.max_turns
        # counted, not required 0: a BPE model may sample ids that are not the tokenizer's own
        # encoding of their text (docs/usage.md, agent/template_mismatch)
        assert 0 <= m["agent/template_mismatch"] <= cfg.data.train_batch_size * cfg.rollout.n
        assert 1 <= m["response_length/max"] <= cfg.rollout.response_length
        assert 0.0 <= m["critic/score/mean"] <= 1.0 and m["actor/update_successful"] == 1.0
        assert "actor/kl_loss" in m
        # vLLM (fp32) and Megatron agree on every sampled token of every turn
        assert m["training/rollout_probs_diff_max"] < 1e-3
