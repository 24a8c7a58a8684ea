"""The supervised trainers' configs, flat: SFTConfig and RewardConfig over the SupervisedConfig fields they
share. Kept apart from the trainers so the CLI can build its parsers without importing them."""

from __future__ import annotations

from dataclasses import dataclass

from ppoforge.config import default_micro_batch, param
from ppoforge.errors import UserError
from ppoforge.lm.models.export_fields import export_dtype_param, export_param
from ppoforge.runtime.device import check_device_name
from ppoforge.runtime.metrics import REPORT_TO_HELP, report_sinks
from ppoforge.runtime.precision import PRECISION_CHOICES
from ppoforge.runtime.resilience import FaultConfig


@dataclass
class SupervisedConfig(FaultConfig):
    """Fields SFT and reward-model training share (each adds its own)."""

    model: str = param("smollm2-135m-instruct", "model: a checkpoint dir, a hub id or a built-in name")
    tokenizer: str | None = param(None, "tokenizer folder or hub id (none: the model's own)")
    layout: str = param("lora", "lora: train LoRA adapters on a frozen base (see export); full: every "
                        "weight", choices=("lora", "full"))
    fsdp: bool = param(False, "full layout under torchrun: shard the model over the ranks with FSDP2 (each rank "
                       "keeps 1/world of the weights and optimizer state); checkpoints through "
                       "torch.distributed.checkpoint, which resume on any world size")
    lora_r: int = param(16, "LoRA rank", lo=1, hi=4096)
    lora_alpha: float = param(32.0, "LoRA alpha (the update is scaled by alpha / r)", gt=0, hi=1e5)
    lora_target_modules: str = param("all-linear", "modules to adapt: all-linear or comma-separated names")
    export: str = export_param()
    export_dtype: str = export_dtype_param()
    data: str = param("", "training data: a .jsonl/.json/.csv/.parquet file or a datasets name", data=True)
    data_split: str = param("train", "split of a datasets name or folder")
    eval_data: str | None = param(None, "held-out data (same format); none: eval_fraction of data", resume=True)
    eval_fraction: float = param(0.1, "share of data held out when eval_data is none (0: no evaluation)",
                                 lo=0.0, hi=0.9)
    max_length: int = param(512, "tokens per example; longer rows are left out and counted (never truncated)",
                            lo=2, hi=1_000_000)
    strict: bool = param(False, "a row that cannot be used is an error naming its line (else it is counted)")
    batch_size: int = param(16, "examples per optimizer step", lo=1, hi=1_000_000)
    micro_batch_size: int | None = param(None, "examples per forward/backward (accumulated to a batch); none: the "
                                         "largest divisor of batch_size up to 8", lo=1, hi=1_000_000)
    epochs: float = param(1.0, "passes over the training data", gt=0, hi=1e6, resume=True)
    max_steps: int | None = param(None, "stop after this many optimizer steps, whatever epochs says (TRL's "
                                  "max_steps: the learning-rate schedule ends there too); none: epochs decides",
                                  lo=1, hi=10**12, resume=True)
    learning_rate: float = param(2e-4, "AdamW learning rate (full fine-tuning wants ~1e-5)", gt=0, hi=10.0)
    warmup_ratio: float = param(0.05, "share of the steps with a linear learning-rate warm-up", lo=0.0, hi=1.0)
    weight_decay: float = param(0.0, "AdamW weight decay", lo=0.0, hi=10.0)
    max_grad_norm: float = param(1.0, "global gradient-norm clip", gt=0, hi=1e9)
    seed: int = param(1, "seed for the data order and initialization", lo=0, hi=2**32 - 1)
    precision: str = param("auto", "auto: bf16 autocast where the device computes it natively (CUDA >= 8.0, AMX or "
                           "AVX-512-BF16 CPUs), else fp32; fp32, bf16, fp16 (CUDA)", choices=PRECISION_CHOICES)
    device: str = param("auto", "auto (cuda if visible, else cpu), cpu, cuda or cuda:N", resume=True)
    torch_threads: int | None = param(None, "torch intra-op threads (none: torch's default)", lo=1, hi=4096,
                                      resume=True)
    gradient_checkpointing: bool = param(False, "recompute activations in backward to save memory", resume=True)
    eval_every: int = param(50, "evaluate every this many optimizer steps (and at the end)", lo=1, hi=10**9,
                            resume=True)
    checkpoint_every: int = param(100, "save a checkpoint every this many steps (and at the end)", lo=1,
                                  hi=10**9, resume=True)
    log_every: int = param(1, "log metrics every this many steps", lo=1, hi=10**9, resume=True)
    tensorboard: bool = param(True, "also write TensorBoard event files", resume=True)
    report_to: str = param("tensorboard", REPORT_TO_HELP, resume=True)
    progress: bool = param(True, "show a live progress bar", resume=True)

    def finalize(self) -> None:
        report_sinks(self.report_to)
        check_device_name(self.device)
        if self.micro_batch_size is None:  # resolved once here: config.yaml and checkpoints hold the number
            self.micro_batch_size = default_micro_batch(self.batch_size)
        if self.batch_size % self.micro_batch_size:
            raise UserError(f"micro_batch_size: {self.micro_batch_size} does not divide batch_size "
                            f"{self.batch_size}; allowed: a divisor of batch_size")
        if self.fsdp and self.layout != "full":
            raise UserError(f"fsdp: shards a fully trained model; layout {self.layout} trains adapters, which plain "
                            "data parallelism replicates; allowed: layout full, or fsdp false")
        if self.fsdp and self.precision == "fp16":
            raise UserError("precision: fp16 is not supported with fsdp (its GradScaler would need a found-inf "
                            "all-reduce across ranks); allowed: fp32, bf16, auto")

    def check_data(self) -> None:
        """Training needs `data`; a config may be built without it (the Python API's trainers take the rows as
        `train_dataset`), so the trainers and the pipeline check it, not `finalize`."""
        if not self.data:
            raise UserError("data: required; allowed: a .jsonl/.json/.csv/.parquet file or a datasets name")

@dataclass
class SFTConfig(SupervisedConfig):
    preset_domain = "sft"  # its built-in presets: configs/sft/ (`from_preset`)
    packing: bool = param(False, "pack several examples into each row (no attention across them)")
    sample_prompts: int = param(3, "held-out prompts completed at each evaluation (written to samples.jsonl)",
                                lo=0, hi=1000, resume=True)
    sample_tokens: int = param(48, "new tokens per sample completion", lo=1, hi=100_000, resume=True)

@dataclass
class RewardConfig(SupervisedConfig):
    preset_domain = "reward"  # its built-in presets: configs/reward/ (`from_preset`)
    center_coef: float = param(0.0, "reward centering: + this * mean((r_chosen + r_rejected)^2) (TRL: 0.01)",
                               lo=0.0, hi=1e3)
    shared_prefix: str = param("auto", "a causal model scores each pair as one row, the prompt once (tree mask); "
                               "off: chosen and rejected as two right-padded rows", choices=("auto", "off"),
                               resume=True)
    use_margin: bool = param(True, "subtract the data's per-pair `margin` column from the gap, where it has one")
