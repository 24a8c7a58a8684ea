"""`ppoforge train reward`: a scalar reward model from preference pairs, the second stage of RLHF.

Any `AutoModelForSequenceClassification` with one label: a causal LM (the score at the last real token)
or an encoder such as MiniLM (its pooled first token). For a causal model, chosen and rejected share
their prompt: each pair is ONE row `[prompt, chosen's rest, rejected's rest]` with a tree mask
(`rows.branch_rows`; `shared_prefix: auto`), so the prompt is computed once and neither side pads to the
other; an encoder (or `shared_prefix: off`, or FSDP) runs both in one right-padded forward. The loss
is Bradley-Terry with an optional per-pair margin and reward centering
(`core/preference.py`). The input is what `rewards.RewardModelScorer` feeds it when it scores PPO
samples (`examples.reward_input_ids`), so the export is a reward PPO can use as it is
(`train rlhf --reward model:PATH`) and, for a causal model, a critic to start from
(`--layout full --critic-model PATH`: trunk and score head). Evaluation: pairwise accuracy and the mean
reward gap on held-out pairs, and a histogram of the gaps (`reward_gaps.png`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ppoforge.core.preference import bradley_terry_loss
from ppoforge.errors import UserError
from ppoforge.lm.models.attention import right_pad
from ppoforge.lm.models.loading import finish_loaded_reward_model, is_causal, load_reward_model
from ppoforge.lm.models.parts import export, lora_config, lora_wrap
from ppoforge.lm.models.rows import branch_rows, shared_length
from ppoforge.lm.models.windows import attention_window
from ppoforge.lm.supervised.config import RewardConfig
from ppoforge.lm.supervised.examples import Pair, preference_pairs
from ppoforge.lm.supervised.loop import SupervisedTrainer, load_data, prepare
from ppoforge.runtime import distributed, rundir
from ppoforge.runtime.fsdp import shard_model
from ppoforge.runtime.precision import make_precision


class RewardObjective:
    name = "reward"
    stat_keys = ("accuracy", "gap")  # what `loss` (bradley_terry_loss) returns besides the loss
    sharded = False  # FSDP2 (`shard`): the model's weights are this rank's shards

    def __init__(self, cfg: RewardConfig, run_dir: Path, model=None, tokenizer=None):
        """`model` / `tokenizer`: the Python API's, already loaded (copies are trained), in place of `cfg.model`'s."""
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.device, self.tokenizer = prepare(cfg, tokenizer, model)
        self.train_items, self.eval_items, _, where, drops = load_data(cfg, self.run_dir, self.tokenizer,
                                                                       preference_pairs)
        if not self.train_items:
            raise UserError(f"data: no usable pairs in {where} ({drops.summary(0)}); allowed: rows with chosen "
                            "and rejected (and prompt)")
        dtype = make_precision(cfg.precision, self.device).dtype if cfg.layout == "lora" else None
        model = (load_reward_model(cfg.model, dtype or torch.float32, self.device, tokenizer=self.tokenizer)
                 if model is None else finish_loaded_reward_model(model, self.tokenizer, dtype or torch.float32,
                                                                  self.device))
        self.model = (lora_wrap(model, lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules, "SEQ_CLS"))
                      if cfg.layout == "lora" else model.train(False))
        if cfg.layout == "lora":  # peft keeps the score head trainable (modules_to_save), in fp32
            for n, p in self.model.named_parameters():
                if "modules_to_save" in n:
                    p.data = p.data.float()
        self._trainable = [(n, p) for n, p in self.model.named_parameters()
                           if cfg.layout == "full" or "lora_" in n or "modules_to_save" in n]
        self.causal = is_causal(model.config.model_type)
        # branch rows' tree mask is one 4D mask for every layer: exact for a windowed model only while a side
        # fits its window (windows.py); past it right-padded rows get the model's own per-layer masks
        window = attention_window(model.config)
        self.within_window = window is None or cfg.max_length <= window
        self.backbone, self.head = getattr(model, model.base_model_prefix), getattr(model, "score", None)
        for _, p in self._trainable:
            p.requires_grad_(True)

    def trainable(self):
        return self._trainable

    def shard(self, precision: str) -> None:
        """FSDP2 over the ranks (runtime/fsdp.py): each layer a group, the model (its score head) the root."""
        shard_model(self.model, precision)
        self._trainable = list(self.model.named_parameters())
        self.sharded = True

    def checkpoint_module(self) -> torch.nn.Module:
        return self.model

    def release(self) -> None:
        pass  # every group reshards after its forward

    @property
    def branched(self) -> bool:
        """One row per pair (the prompt once): a causal model with its `score` head, called part by part,
        which FSDP's root (the whole model) would not gather, whose windows (if any) hold max_length."""
        return (self.cfg.shared_prefix == "auto" and self.causal and self.head is not None and not self.sharded
                and self.within_window)

    def size(self, item: Pair) -> int:
        if self.branched:
            return len(item.chosen) + len(item.rejected) - shared_length([item.chosen, item.rejected])
        return max(len(item.chosen), len(item.rejected))

    def units(self, items: list[Pair]) -> torch.Tensor:
        return torch.tensor(float(len(items)), device=self.device)

    def rewards(self, items: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
        """(r_chosen, r_rejected), (B,) fp32 each, from one forward of both sides."""
        if self.branched:
            rows = branch_rows([[p.chosen, p.rejected] for p in items], self.tokenizer.pad_token_id, self.device)
            hidden = self.backbone(**rows.inputs(self.backbone)).last_hidden_state
            scores = self.head(hidden.flatten(0, 1)[rows.last])[:, 0].float()  # (2B,) chosen, rejected, ...
            return scores[0::2], scores[1::2]
        ids, mask = right_pad([p.chosen for p in items] + [p.rejected for p in items], self.tokenizer.pad_token_id,
                              self.device)
        # A causal model needs no padding mask for right-padded rows (its score is read at the last real
        # token, found from the pad ids, and nothing before it sees the padding): SDPA's causal kernel.
        scores = self.model(input_ids=ids, **({} if self.causal else {"attention_mask": mask})).logits[:, 0].float()
        return scores[:len(items)], scores[len(items):]

    def loss(self, items):
        r_chosen, r_rejected = self.rewards(items)
        margin = (torch.tensor([p.margin for p in items], device=self.device)
                  if self.cfg.use_margin and any(p.margin for p in items) else None)
        return bradley_terry_loss(r_chosen, r_rejected, margin, self.cfg.center_coef)

    def evaluate(self, items) -> dict:
        gaps = [torch.sub(*self.rewards(items[s:s + self.cfg.micro_batch_size])).float()
                for s in range(0, len(items), self.cfg.micro_batch_size)]
        gaps = torch.cat(gaps).tolist() if gaps else []
        # every rank's (sharded, every rank scored every pair: FSDP's lockstep)
        gaps = torch.tensor(gaps if self.sharded else distributed.gather_rows(gaps))  # cpu: host floats: plot, float()
        if distributed.is_main():
            plot_gaps(gaps, self.run_dir / "reward_gaps.png")
        return {"eval/accuracy": float((gaps > 0).float().mean()), "eval/gap": float(gaps.mean()),
                "eval/pairs": len(gaps)}

    def export(self, path: Path, kind: str = "adapter", dtype: torch.dtype | None = None) -> Path:
        return export(self.model, path, kind, dtype, self.tokenizer, self.sharded)


def plot_gaps(gaps: torch.Tensor, out_png: Path) -> None:
    """Histogram of r_chosen - r_rejected over held-out pairs: mass right of 0 is ranked right."""
    import matplotlib  # plotting only: matplotlib loads when a plot is drawn, not with the trainer

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.hist(gaps.cpu().numpy(), bins=30, color="tab:blue", alpha=0.8)
    ax.axvline(0, color="black", lw=1)
    ax.set_xlabel("reward gap  r(chosen) - r(rejected)")
    ax.set_ylabel("held-out pairs")
    ax.set_title(f"accuracy {float((gaps > 0).float().mean()):.1%}, mean gap {float(gaps.mean()):+.2f}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def train(cfg: RewardConfig, run_dir: Path, resume: bool = False) -> dict:
    """Train (or, with resume, continue) a reward model in `run_dir`; exported to run_dir/model."""
    cfg.check_data()
    with rundir.hold(run_dir):  # one run at a time in a run dir
        trainer = SupervisedTrainer(cfg, run_dir, RewardObjective(cfg, run_dir))
        if resume:
            trainer.resume()
        return trainer.run()
