"""The Python API (src/ppoforge/api.py, docs/api.md): `import ppoforge` stays light, configs are checked on
construction with the CLI's lines, RLHFTrainer's train() writes the CLI's run dir and step() one CLI update at a
time, loaded models and reward callables go in unchanged, save_pretrained's two folders load, and every
```python block of docs/api.md runs as written. Tiny random models built here (lm/models/tiny.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ppoforge
from ppoforge import ControlConfig, RewardConfig, RLHFConfig, RLHFTrainer, SFTConfig, SFTTrainer, UserError
from ppoforge.cli import main
from ppoforge.config import build_config
from ppoforge.lm.models.tiny import save_tiny_lm
from ppoforge.runtime.metrics import read_metrics

DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"
PROMPTS = ["tell a story about the rain", "write one sentence about coffee", "describe the city at night",
           "a review of a good movie"]
CONFIGS = [(RLHFConfig, "rlhf"), (SFTConfig, "sft"), (RewardConfig, "reward"), (ControlConfig, "control")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_lm(tmp_path_factory.mktemp("api") / "tiny-lm")


def small(**fields) -> RLHFConfig:
    """GRPO on the tiny model: 4 prompts x 8 completions of 6 tokens, fp32, quiet."""
    return RLHFConfig.from_preset("grpo", **{"max_new_tokens": 6, "total_updates": 2, "progress": False,
                                             "tensorboard": False, "learning_rate": 1e-2, **fields})


def lengths(prompts, completions, **row_fields):
    return [float(len(c)) for c in completions]


def test_import_ppoforge_loads_no_torch_and_names_the_api():
    code = "import sys, ppoforge; print('torch' in sys.modules, 'transformers' in sys.modules, ppoforge.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == ["False", "False"] and out[2] == ppoforge.__version__
    for name in ppoforge.__all__:
        assert getattr(ppoforge, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'GRPOTrainer'"):
        ppoforge.GRPOTrainer  # noqa: B018 - the lookup is the test


@pytest.mark.parametrize(("cls", "domain"), CONFIGS, ids=[d for _, d in CONFIGS])
def test_a_config_refuses_a_bad_value_on_construction_with_the_clis_line(cls, domain, capsys):
    with pytest.raises(UserError) as python:
        cls(learning_rate=-1)
    assert str(python.value) == "learning_rate: -1.0 is out of range; allowed: > 0"
    with pytest.raises(UserError) as built:
        build_config(cls, {"learning_rate": "-1"})
    assert str(built.value) == str(python.value)
    assert main(["train", domain, "--learning-rate", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(str(python.value))
    with pytest.raises(UserError, match="^seed: 'x' is not an integer; allowed: an integer >= 0"):
        cls(seed="x")


def test_a_config_coerces_checks_across_fields_and_reads_presets():
    assert RLHFConfig(batch_size="4", mini_batch_size=4, micro_batch_size=2).batch_size == 4
    with pytest.raises(UserError, match="^mini_batch_size: 3 does not divide batch_size 16; allowed: a divisor"):
        RLHFConfig(mini_batch_size=3)
    grpo = RLHFConfig.from_preset("grpo", learning_rate=1e-5)
    assert (grpo.advantage, grpo.num_generations, grpo.kl_in, grpo.learning_rate) == ("grpo", 8, "loss", 1e-5)
    with pytest.raises(UserError, match="^learning_rate: -1.0 is out of range"):
        RLHFConfig.from_preset("grpo", learning_rate=-1)
    with pytest.raises(UserError, match="^preset: no built-in preset 'nope'; allowed: .*grpo"):
        RLHFConfig.from_preset("nope")
    assert ControlConfig.from_preset("cartpole").num_envs == 4 and SFTConfig.from_preset("tiny").lora_r == 8


def test_sft_data_is_required_where_training_starts_and_its_model_is_a_causal_lm(tmp_path):
    assert SFTConfig().data == ""  # train_dataset may come later
    with pytest.raises(UserError, match="^data: required; allowed:"):
        SFTTrainer(model="any", args=SFTConfig(), output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="^model: a Linear is not a causal LM; allowed: a transformers model"):
        SFTTrainer(model=torch.nn.Linear(2, 2), train_dataset=[{"prompt": "a", "completion": "b"}],
                   output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_grpo_and_ppo_configs_are_trls_names_for_rlhf_config():
    from ppoforge import GRPOConfig, PPOConfig

    grpo = GRPOConfig(learning_rate=1e-5, num_generations=4)
    assert type(grpo) is RLHFConfig and grpo == RLHFConfig.from_preset("grpo", learning_rate=1e-5, num_generations=4)
    assert (grpo.advantage, grpo.kl_in, grpo.num_generations) == ("grpo", "loss", 4)
    assert PPOConfig is RLHFConfig and PPOConfig(kl_coef=0.1).advantage == "gae"
    with pytest.raises(UserError, match="^learning_rate: -1.0 is out of range; allowed: > 0"):
        GRPOConfig(learning_rate=-1)
    with pytest.raises(UserError, match="^unknown config key 'beta'; allowed keys:"):
        GRPOConfig(beta=0.04)


def test_step_writes_each_update_and_checkpoints_at_the_configs_cadence(tiny, tmp_path):
    run = tmp_path / "run"
    trainer = RLHFTrainer(model=str(tiny), reward_funcs=[lengths], train_dataset=PROMPTS,
                          args=small(total_updates=3, checkpoint_every=2), output_dir=run)
    first = trainer.step()
    assert trainer.update == 1 and all(type(v) is float for v in first.values())
    assert {"objective/scores", "objective/kl", "loss/policy_avg", "episode"} <= set(first)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]
    assert not (run / "checkpoint.pt").exists()  # checkpoint_every 2
    trainer.step()
    assert torch.load(run / "checkpoint.pt", weights_only=False)["update"] == 2
    assert not (run / "model").exists()
    last = trainer.step()
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["objective/scores"] == pytest.approx(last["objective/scores"])
    assert torch.load(run / "checkpoint.pt", weights_only=False)["update"] == 3
    assert (run / "model" / "adapter_config.json").is_file() and (run / "reward_kl.png").is_file()
    assert json.loads((run / "summary.json").read_text())["stopped_by"] is None  # the CLI's closing summary
    with pytest.raises(UserError, match="^total_updates: the run has done its 3 updates"):
        trainer.step()


def test_a_stop_signal_inside_step_keeps_the_last_completed_update_and_exports_nothing(tiny, tmp_path):
    calls = []

    def stopping(prompts, completions, **row_fields):
        calls.append(1)
        if len(calls) == 2:  # inside the second update's reward: as a SIGTERM from a scheduler
            os.kill(os.getpid(), signal.SIGTERM)
        return [float(len(c)) for c in completions]

    run = tmp_path / "run"
    trainer = RLHFTrainer(model=str(tiny), reward_funcs=stopping, train_dataset=PROMPTS, args=small(), output_dir=run)
    assert trainer.step() and trainer.update == 1
    assert trainer.step() == {} and trainer.update == 1
    assert torch.load(run / "checkpoint.pt", weights_only=False)["update"] == 1
    assert not (run / "model").exists() and [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]


def test_train_writes_the_run_dir_the_cli_writes(tiny, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cli_run, api_run = tmp_path / "cli", tmp_path / "api"
    assert main(["train", "rlhf", "--preset", "grpo", "--model", str(tiny), "--prompts", str(prompts), "--reward",
                 "length:4", "--max-new-tokens", "6", "--total-updates", "2", "--progress", "false",
                 "--learning-rate", "1e-2", "--run-dir", str(cli_run)]) == 0, capsys.readouterr().err
    result = RLHFTrainer(model=str(tiny), reward_funcs="length:4", train_dataset=PROMPTS,
                         args=small(progress=False, tensorboard=True), output_dir=api_run).train()
    assert (result.updates, result.stopped_by) == (2, None)
    assert sorted(p.name for p in api_run.iterdir()) == sorted([p.name for p in cli_run.iterdir()] + ["prompts.jsonl"])
    numbers = [[{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(run / "metrics.jsonl")]
               for run in (cli_run, api_run)]
    assert numbers[0] == numbers[1] and len(numbers[0]) == 2


def test_a_loaded_model_and_reward_callables_go_in_unchanged(tiny, tmp_path):
    lm, tok = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    side, seen = tok.padding_side, []

    def correct(prompts, completions, *, finished, answer, **row_fields):
        seen.append((answer, finished))
        return [float(a in c) for c, a in zip(completions, answer, strict=True)]

    rows = [{"prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS)]
    trainer = RLHFTrainer(model=lm, tokenizer=tok, reward_funcs=[correct, lengths], train_dataset=rows,
                          args=small(total_updates=1, reward_weights="1,0.5"), output_dir=tmp_path / "run")
    assert trainer.layout.policy_model is not lm
    trainer.step()
    answers, finished = seen[0]
    assert sorted(set(answers)) == ["0", "1", "2", "3"]
    assert len(finished) == 32 and all(type(f) is bool for f in finished)
    assert all(torch.equal(before[n], p) for n, p in lm.named_parameters()) and tok.padding_side == side
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "reward: python:correct,lengths" in saved and f"model: {tiny}" in saved


def test_save_pretrained_merged_and_adapter_load_as_the_trained_policy(tiny, tmp_path):
    trainer = RLHFTrainer(model=str(tiny), reward_funcs=lengths, train_dataset=PROMPTS, args=small(total_updates=1),
                          output_dir=tmp_path / "run")
    trainer.step()
    merged_dir, adapter_dir = trainer.save_pretrained(tmp_path / "merged"), tmp_path / "adapter"
    trainer.save_pretrained(adapter_dir, adapter_only=True)
    from peft import PeftModel  # the adapter's loader, as users load it

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        trained = trainer.layout.policy_model(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)(ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), adapter_dir)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny)(ids).logits
    assert (merged - base).abs().max() > 1e-4  # the update moved the policy
    torch.testing.assert_close(merged, trained, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(adapted, trained, atol=1e-5, rtol=1e-4)
    assert (merged_dir / "tokenizer_config.json").is_file() and not (adapter_dir / "model.safetensors").exists()
    full = RLHFTrainer(model=str(tiny), reward_funcs=lengths, train_dataset=PROMPTS,
                       args=small(total_updates=1, layout="full"), output_dir=tmp_path / "full")
    with pytest.raises(UserError, match="^adapter_only: the full layout trains every weight"):
        full.save_pretrained(tmp_path / "x", adapter_only=True)


def test_a_used_output_dir_is_refused_unless_overwrite_and_bad_rows_are_one_line(tiny, tmp_path):
    run = tmp_path / "run"
    RLHFTrainer(model=str(tiny), reward_funcs=lengths, train_dataset=PROMPTS, args=small(total_updates=1),
                output_dir=run).step()
    with pytest.raises(UserError, match=f"^run_dir: {re.escape(str(run))} already holds a run"):
        RLHFTrainer(model=str(tiny), reward_funcs=lengths, train_dataset=PROMPTS, args=small(), output_dir=run)
    again = RLHFTrainer(model=str(tiny), reward_funcs=lengths, train_dataset=PROMPTS[:2], args=small(),
                        output_dir=run, overwrite=True)
    assert again.cfg.prompts == str(run / "prompts.jsonl")
    assert len((run / "prompts.jsonl").read_text().splitlines()) == 2
    with pytest.raises(UserError, match="^train_dataset: row 2 is a int; allowed: a list of strings"):
        RLHFTrainer(model=str(tiny), reward_funcs=lengths, train_dataset=["ok", 3], output_dir=tmp_path / "bad")
    with pytest.raises(UserError, match="^reward_funcs: a mix of reward specs and callables"):
        RLHFTrainer(model=str(tiny), reward_funcs=["vader", lengths], output_dir=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_every_python_block_of_docs_api_md_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) >= 6
    namespace: dict = {"__name__": "__main__"}
    for i, block in enumerate(blocks, 1):
        assert len(block.splitlines()) <= 25, f"docs/api.md block {i} is not short"
        exec(compile(block, f"docs/api.md block {i}", "exec"), namespace)  # noqa: S102 - the page's own code
    for folder in ("runs/grpo/model", "runs/sums/model", "runs/by-hand/model", "runs/sft/model", "runs/rm/model",
                   "runs/rm-loaded/model", "tuned", "tuned-adapter"):
        assert (tmp_path / folder).is_dir(), folder
    assert (tmp_path / "runs/cartpole-steps/learning_curve.png").is_file()
    assert (tmp_path / "runs/cartpole/checkpoint.pt").is_file() and namespace["result"].global_step == 2048
