"""One GRPO update of TRL and of ppoforge on the same rollouts, compared step by step.

    # 1. TRL's GRPOTrainer trains K updates and records each one (in the TRL venv):
    .bench-venvs/trl-current/bin/python benchmarks/grpo_step_parity.py trl --task-dir DIR --model-dir M --out rec.pt
    # 2. ppoforge replays the same K rollouts from the same LoRA initialisation (in this venv) and compares:
    .venv/bin/python benchmarks/grpo_step_parity.py ppoforge --task-dir DIR --record rec.pt

What is compared, per update (the questions of issue 36's item 2): the rewards ppoforge's reward computes
on TRL's completions; the advantages; the loss; each LoRA weight's gradient after clipping (cosine and norm
ratio, over all of them and the worst tensor); the gradient norm before clipping; the learning rate; the
weights after the optimizer step (the optimizer state shows there from step 2 on). The rollouts are TRL's:
ppoforge's collector is replaced by one that hands over TRL's prompt and completion token ids, so the
sampling is held equal and everything after it is what differs. Both sides run in fp32.

The task folder is `learning_task.build`'s (or `learning_battery.py`'s, any task of its battery); the
settings are the `arithmetic_demo` preset's, as learning_vs_trl.py's two workers use them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import learning_task  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("side", choices=["trl", "ppoforge"])
    p.add_argument("--task-dir", required=True)
    p.add_argument("--model-dir", help="trl: the SmolLM2-135M-Instruct folder")
    p.add_argument("--out", help="trl: the record to write")
    p.add_argument("--record", help="ppoforge: the record TRL wrote")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="ppoforge: write the comparison here")
    return p.parse_args()


def lora_key(name: str) -> str:
    """'base_model.model.model.layers.3.mlp.up_proj.lora_A.default.weight' -> 'layers.3.mlp.up_proj.lora_A'."""
    m = re.search(r"(layers\.\d+\..*?lora_[AB])", name)
    return m.group(1) if m else name


def record_trl(args: argparse.Namespace) -> None:
    """TRL's GRPOTrainer with trl_learning_worker.py's settings, `--updates` steps, each one recorded."""
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    policy = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    eos = policy.generation_config.eos_token_id
    policy.generation_config.eos_token_id = [*(eos if isinstance(eos, list) else [eos]),
                                             tok.convert_tokens_to_ids("Ċ")]
    rows = learning_task.read_rows(Path(args.task_dir) / "train.jsonl")
    cfg = json.loads((Path(args.task_dir) / "task.json").read_text())["settings"]
    completions = cfg["batch_size"] * cfg["num_generations"]
    data = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "entry": [r["entry"] for r in rows]})
    steps: list[dict] = []

    def lora_state(model) -> dict:
        return {lora_key(k): v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}

    class Recorder(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            steps.append({"prompts": [x["prompt"] for x in inputs], "entries": [x["entry"] for x in inputs],
                          **{k: out[k].detach().clone() for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                  "completion_mask", "advantages")},
                          "rewards": torch.tensor(self._metrics["train"]["reward"][-1:]), "losses": []})
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            steps[-1]["losses"].append(float(loss))
            return loss

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, targs, state, control, **kw):
            steps[-1]["grads"] = {lora_key(n): p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                                  if p.requires_grad and p.grad is not None}
            steps[-1]["lr"] = trainer.lr_scheduler.get_last_lr()[0]

        def on_optimizer_step(self, targs, state, control, **kw):
            steps[-1]["after"] = lora_state(trainer.model)

        def on_step_end(self, targs, state, control, **kw):
            control.should_training_stop = state.global_step >= args.updates
            return control

    import tempfile
    with tempfile.TemporaryDirectory(prefix="grpo-parity-") as tmp:
        config = trl.GRPOConfig(
            output_dir=tmp, report_to=[], save_strategy="no", disable_tqdm=True, seed=args.seed, use_cpu=True,
            bf16=False, per_device_train_batch_size=16, gradient_accumulation_steps=completions // 16,
            num_generations=cfg["num_generations"], max_completion_length=cfg["max_new_tokens"],
            temperature=cfg["temperature"], beta=0.0, learning_rate=float(cfg["learning_rate"]),
            lr_scheduler_type="constant", warmup_steps=0, max_steps=10**5, logging_steps=1,
            gradient_checkpointing=False, loss_type="grpo", scale_rewards="group")
        trainer = Recorder(model=policy, reward_funcs=learning_task.answer_reward, args=config, train_dataset=data,
                           processing_class=tok, peft_config=LoraConfig(**learning_task.LORA), callbacks=[Grads()])
        init = lora_state(trainer.model)
        trainer.train()
    torch.save({"init": init, "steps": steps, "trl": trl.__version__, "settings": cfg}, args.out)
    print(f"[trl] {len(steps)} updates recorded to {args.out}")


def cosine_and_ratio(a: dict, b: dict) -> dict:
    """Over all tensors flattened: cosine, |b| / |a|; and the worst single tensor's cosine."""
    import torch

    keys = sorted(a)
    a, b = {k: a[k].double() for k in keys}, {k: b[k].double() for k in keys}  # cosines of ~5M numbers: float64
    va, vb = torch.cat([a[k].flatten() for k in keys]), torch.cat([b[k].flatten() for k in keys])
    keys = [k for k in keys if a[k].any() or b[k].any()]  # lora_A's first gradient is 0 (B starts at 0)
    worst = min(keys, key=lambda k: float(torch.nn.functional.cosine_similarity(a[k].flatten(), b[k].flatten(), 0)))
    return {"cosine": float(torch.nn.functional.cosine_similarity(va, vb, 0)),
            "norm_ratio": float(vb.norm() / va.norm()),
            "worst_tensor": worst,
            "worst_cosine": float(torch.nn.functional.cosine_similarity(a[worst].flatten(), b[worst].flatten(), 0)),
            "max_abs_diff": float((va - vb).abs().max())}


def replay_ppoforge(args: argparse.Namespace) -> dict:
    """ppoforge's trainer (the preset's settings, fp32) from TRL's LoRA initialisation, on TRL's rollouts."""
    import torch
    from peft import set_peft_model_state_dict

    from ppoforge.config import build_config, read_preset
    from ppoforge.lm.models.sampler import Samples
    from ppoforge.lm.rl.collect import Batch
    from ppoforge.lm.rl.config import RLHFConfig
    from ppoforge.lm.rl.trainer import RLHFTrainer

    rec = torch.load(args.record, weights_only=False)
    torch.set_num_threads(args.threads)
    preset = read_preset("arithmetic_demo", "rlhf")
    task = json.loads((Path(args.task_dir) / "task.json").read_text())["settings"]  # a battery task's budget
    cfg = build_config(RLHFConfig, {
        **preset, **{k: task[k] for k in ("max_new_tokens",) if k in task},
        "prompts": str(Path(args.task_dir) / "train.jsonl"), "heldout_prompts": None,
        "reward": f"py:{HERE / 'learning_task.py'}:answer_reward", "total_updates": 100, "seed": args.seed,
        "precision": "fp32", "torch_threads": args.threads, "checkpoint_every": 10**9, "tensorboard": False,
        "progress": False, "max_prompt_tokens": 1024})
    import tempfile
    trainer = RLHFTrainer(cfg, Path(tempfile.mkdtemp(prefix="grpo-parity-ppoforge-")))
    peft_model = trainer.layout.peft
    names = {lora_key(n): n for n, _ in peft_model.named_parameters() if "lora_" in n}
    set_peft_model_state_dict(peft_model, {names[k].replace(".default", ""): v for k, v in rec["init"].items()})
    tok = trainer.tokenizer
    out = {"trl": rec["trl"], "updates": []}
    seen: dict = {}  # this update's gradients, learning rate and advantages, caught on their way

    def pre_step(opt, a, k):
        seen["grads"] = {lora_key(n): p.grad.detach().clone() for n, p in peft_model.named_parameters()
                         if p.requires_grad and p.grad is not None}
        seen["lr"] = opt.param_groups[0]["lr"]

    def ppo_update(b, real_update=trainer.ppo_update):
        seen["adv"] = b.adv.detach().clone()
        return real_update(b)

    trainer.optimizer.register_step_pre_hook(pre_step)
    trainer.ppo_update = ppo_update
    for step in rec["steps"]:
        comp, cmask = step["completion_ids"], step["completion_mask"].float()
        finished = torch.tensor([bool(m.sum() < m.numel() or int(c[int(m.sum()) - 1]) in trainer.inputs.stop_ids)
                                 for c, m in zip(comp, cmask, strict=True)])
        comp = comp.masked_fill(cmask == 0, tok.pad_token_id)
        texts = tok.batch_decode([c[m.bool()] for c, m in zip(comp, cmask, strict=True)], skip_special_tokens=True)
        rows = [{"prompt": p, "entry": e} for p, e in zip(step["prompts"], step["entries"], strict=True)]
        samples = Samples(comp, cmask, torch.zeros_like(cmask), finished)
        batch = Batch(rows, torch.cat([step["prompt_ids"], comp], 1), step["prompt_mask"], samples, texts,
                      step["prompts"])
        trainer.collect = lambda prompts, batch=batch: batch
        seen.clear()
        metrics, _ = trainer.train_one_update()
        after = {lora_key(n): p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}
        row = {"update": trainer.update, "trl_mean_reward": float(step["rewards"].mean()),
               "ppoforge_mean_score": metrics["objective/scores"],
               "ppoforge_loss": metrics.get("loss/policy_avg"), "trl_loss": sum(step["losses"]),
               "flat_skipped": metrics["guard/flat_rollout_skipped"],
               "shared_prefix_unit": metrics["perf/shared_prefix_unit"],  # k > 1: one prompt row per group
               "lr": {"trl": step.get("lr"), "ppoforge": seen.get("lr")}}
        if "adv" in seen:  # ppoforge's (B, T) on every token of a response; TRL's (B,)
            row["adv_max_abs_diff"] = float((seen["adv"][:, 0] - step["advantages"]).abs().max())
        if "grads" in seen and "grads" in step:
            row["grads"] = cosine_and_ratio(step["grads"], seen["grads"])
        row["weights_after"] = cosine_and_ratio({k: step["after"][k] - rec["init"][k] for k in step["after"]},
                                                {k: after[k] - rec["init"][k] for k in step["after"]})
        out["updates"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def main() -> None:
    args = parse_args()
    if args.side == "trl":
        record_trl(args)
    else:
        replay_ppoforge(args)


if __name__ == "__main__":
    main()
