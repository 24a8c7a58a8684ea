"""`ppoforge train sft`: supervised fine-tuning of a causal LM, the first stage of RLHF.

The loss is the mean negative log-likelihood of the completion (or every assistant turn) tokens, never
of the prompt (`examples.py` builds the masks from the chat template's own rendering). The LM head runs
only at the positions that predict a target token, in the memory-light chunked log-prob of
`logprobs.py`. With `packing`, several examples share a row without attending to each other
(`packing.py`). LoRA (merged in fp32 on export) or full fine-tuning; the export is a plain
`save_pretrained` folder that `ppoforge train rlhf --model` takes as it is.
Left out: NEFTune noise, DPO-style losses, multi-turn data synthesis.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ppoforge.errors import UserError
from ppoforge.lm.models.attention import as_attention_bias, left_pad
from ppoforge.lm.models.decoders import HFDecoder
from ppoforge.lm.models.loading import finish_loaded_lm, load_causal_lm
from ppoforge.lm.models.logprobs import head_logprobs
from ppoforge.lm.models.parts import (
    Trunk,
    enable_gradient_checkpointing,
    export,
    head_size,
    lora_config,
    lora_wrap,
    output_head,
)
from ppoforge.lm.models.sampler import SamplingParams, sample
from ppoforge.lm.models.windows import attention_window, check_window
from ppoforge.lm.supervised.config import SFTConfig
from ppoforge.lm.supervised.examples import Example, sft_examples
from ppoforge.lm.supervised.loop import SupervisedTrainer, load_data, prepare
from ppoforge.lm.supervised.packing import collate, pack
from ppoforge.runtime import distributed, rundir
from ppoforge.runtime.fsdp import full_weights, reshard, shard_model
from ppoforge.runtime.precision import make_precision


class SFTObjective:
    name = "sft"
    stat_keys = ("accuracy_proxy",)  # what `loss` returns besides the loss
    sharded = False  # FSDP2 (`shard`): the model's weights are this rank's shards

    def __init__(self, cfg: SFTConfig, run_dir: Path, model=None, tokenizer=None):
        """`model` / `tokenizer`: the Python API's, already loaded (copies are trained), in place of `cfg.model`'s."""
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.device, self.tokenizer = prepare(cfg, tokenizer, model)
        train, held, self.eval_rows, where, drops = load_data(cfg, self.run_dir, self.tokenizer, sft_examples)
        if not train:
            raise UserError(f"data: no usable rows in {where} ({drops.summary(0)}); allowed: rows with messages, "
                            "or prompt and completion")
        self.train_items = pack(train, cfg.max_length) if cfg.packing else [[ex] for ex in train]
        self.eval_items = [[ex] for ex in held]
        dtype = make_precision(cfg.precision, self.device).dtype if cfg.layout == "lora" else None
        model = (load_causal_lm(cfg.model, dtype or torch.float32, self.device, tokenizer=self.tokenizer)
                 if model is None else finish_loaded_lm(model, self.tokenizer, dtype or torch.float32, self.device))
        if cfg.packing:  # a packed row's block mask is one 4D mask for every layer: full attention (windows.py)
            check_window(model.config, cfg.max_length, f"packed examples of up to max_length {cfg.max_length}",
                         "packing false (one example a row: the model's own masks, exact at any length), or "
                         "max_length <= {window}", "packing")
        self.model = (lora_wrap(model, lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules, "CAUSAL_LM"))
                      if cfg.layout == "lora" else model.train(False))
        self.lm = self.model.get_base_model() if cfg.layout == "lora" else self.model
        self.trunk = Trunk(self.lm).eval()
        self.vocab = head_size(self.lm)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(self.lm)
        self._trainable = [(n, p) for n, p in self.model.named_parameters() if cfg.layout == "full" or "lora_" in n]
        for _, p in self._trainable:
            p.requires_grad_(True)

    def trainable(self):
        return self._trainable

    def shard(self, precision: str) -> None:
        """FSDP2 over the ranks (runtime/fsdp.py): each decoder layer a group, `Trunk` the root."""
        shard_model(self.trunk, precision, reshard_root=False)  # the LM head runs after its forward
        self._trainable = list(self.model.named_parameters())
        self.sharded = True

    def checkpoint_module(self) -> torch.nn.Module:
        return self.trunk

    def release(self) -> None:
        if self.sharded:
            reshard(self.trunk)

    def size(self, item: list[Example]) -> int:
        return sum(len(ex.ids) for ex in item)

    def units(self, items: list[list[Example]]) -> torch.Tensor:
        return torch.tensor(float(sum(sum(ex.loss_mask[1:]) for row in items for ex in row)), device=self.device)

    def _target_logprobs(self, items: list[list[Example]]) -> torch.Tensor:
        """Log-probs (N,) fp32 of every target token of the batch, the LM head only at their positions."""
        batch = collate(items, self.tokenizer.pad_token_id, self.device)
        backbone = self.lm.base_model
        if any(len(row) > 1 for row in items):  # packed: each example attends only to itself, from position 0
            masks = {"attention_mask": as_attention_bias(batch.attention(), backbone),
                     "position_ids": batch.positions()}
        else:  # one right-padded example per row: the causal mask alone is exact for every real token (the
            masks = {}  # padding comes after them), and SDPA's is_causal kernel skips the masked half
        hidden = self.trunk(input_ids=batch.ids, use_cache=False, **masks)
        targets = batch.loss_mask[:, 1:].bool()
        hidden = hidden[:, :-1][targets]  # (N, H): positions that predict a target
        return head_logprobs(output_head(self.lm), hidden, batch.ids[:, 1:][targets], self.vocab,
                             entropy=False)[0]

    def loss(self, items):
        logp = self._target_logprobs(items)
        nll = -logp.mean()
        return nll, {"accuracy_proxy": logp.exp().mean().detach()}  # mean probability of the target tokens

    def evaluate(self, items) -> dict:
        total, tokens = 0.0, 0
        for s in range(0, len(items), self.cfg.micro_batch_size):
            logp = self._target_logprobs(items[s:s + self.cfg.micro_batch_size])
            total, tokens = total - float(logp.sum()), tokens + logp.numel()
        if not self.sharded:  # sharded, every rank scored every item (FSDP's lockstep)
            sums = torch.tensor([total, tokens], dtype=torch.float64, device=self.device)
            total, tokens = distributed.all_sum(sums).tolist()
        loss = total / max(tokens, 1)
        if self.sharded:  # every rank samples the same completions in lockstep, each layer gathered per step
            with full_weights(self.trunk):
                self._write_samples()
            self.release()
        elif distributed.is_main():
            self._write_samples()
        return {"eval/loss": loss, "eval/perplexity": float(torch.tensor(loss).exp())}  # cpu: a host float's exp

    def _write_samples(self) -> None:
        """Completions of the first held-out prompts, sampled with a fixed seed, into samples.jsonl."""
        prompts = [_prompt_of(row) for row in self.eval_rows[:self.cfg.sample_prompts]]
        prompts = [p for p in prompts if p is not None]
        if not prompts:
            return
        rendered = [self._render_prompt(p) for p in prompts]
        ids, mask = left_pad(rendered, self.tokenizer.pad_token_id, self.device)
        params = SamplingParams(self.cfg.sample_tokens, 0.7, 0, 1.0, (self.tokenizer.eos_token_id,),
                                self.tokenizer.pad_token_id)
        # a windowed model builds its own per-layer masks: prompt + sample_tokens may outgrow its window
        model = HFDecoder(self.lm, own_masks=True) if attention_window(self.lm.config) else self.lm
        samples = sample(model, ids, mask, params, torch.Generator(self.device).manual_seed(self.cfg.seed))
        lengths = samples.response_mask.sum(1).long().tolist()
        rows = [r[:n] for r, n in zip(samples.response_ids.tolist(), lengths, strict=True)]
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        if not distributed.is_main():
            return
        with (self.run_dir / "samples.jsonl").open("a") as f:
            for p, t in zip(prompts, texts, strict=True):
                f.write(json.dumps({"prompt": p if isinstance(p, str) else p[-1]["content"], "completion": t}) + "\n")

    def _render_prompt(self, prompt) -> list[int]:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(messages[-1]["content"])["input_ids"]

    def export(self, path: Path, kind: str = "adapter", dtype: torch.dtype | None = None) -> Path:
        return export(self.model, path, kind, dtype, self.tokenizer, self.sharded)


def _prompt_of(row: dict):
    """The prompt part of an SFT row: `prompt`, or the messages before the last assistant turn."""
    if "prompt" in row:
        return row["prompt"]
    messages = row.get("messages") or []
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
               default=None)
    return messages[:last] if last else None


def train(cfg: SFTConfig, run_dir: Path, resume: bool = False) -> dict:
    """Fine-tune (or, with resume, continue) in `run_dir`; the model is exported to run_dir/model."""
    cfg.check_data()
    with rundir.hold(run_dir):  # one run at a time in a run dir
        trainer = SupervisedTrainer(cfg, run_dir, SFTObjective(cfg, run_dir))
        if resume:
            trainer.resume()
        return trainer.run()
