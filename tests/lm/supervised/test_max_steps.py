"""`--max-steps` (TRL's max_steps) stops SFT and reward-model training after that many optimizer steps, exported as at
the end of its epochs; `--batch-size 4` alone trains (the micro-batch defaults to a divisor of the batch)."""

import json

import pytest

from ppoforge.cli import main

QUIET = ["--lora-r", "4", "--max-length", "64", "--eval-fraction", "0", "--torch-threads", "1", "--progress", "false",
         "--tensorboard", "false", "--device", "cpu", "--precision", "fp32"]


@pytest.mark.parametrize("trainer", ["sft", "reward"])
def test_max_steps_stops_after_that_many_steps_and_exports(trainer, tmp_path, tiny_lm_dir, tiny_reward_model_dir,
                                                           capsys):
    rows = [{"prompt": f"tell me about the {w}", "completion": f"the {w} is fine", "chosen": f"the {w} is great",
             "rejected": f"the {w} is awful"} for w in ("movie", "book", "city", "train", "coffee", "food")] * 4
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = tiny_lm_dir if trainer == "sft" else tiny_reward_model_dir
    run = tmp_path / "run"
    code = main(["train", trainer, "--model", str(model), "--data", str(data), "--batch-size", "4", "--epochs", "3",
                 "--max_steps", "2", "--run-dir", str(run), *QUIET])  # 24 rows x 3 epochs / 4 would be 18 steps
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("done: 2 steps"), out
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in steps) == 2
    assert any((run / "model").iterdir())  # exported, as at the end of the epochs
    assert "micro_batch_size: 4\n" in (run / "config.yaml").read_text()  # the default divides batch_size 4
