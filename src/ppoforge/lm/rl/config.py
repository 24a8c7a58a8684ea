"""The RLHF trainer's config, flat: RLHFConfig (PPO, TRL's PPOConfig defaults where they exist), its
validation and the values derived from it (which estimator, critic, KL placement, one-step rollouts, the
stats an update reports), computed here once. Kept apart from the trainer so the CLI can build its parsers
without importing it (the estimator records it reads are pure tensor math: `lm/rl/estimators.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ppoforge.config import default_micro_batch, param
from ppoforge.core.accumulation import LOSS_AGGREGATIONS
from ppoforge.core.critic_free import SCALES
from ppoforge.core.kl import KL_ESTIMATORS
from ppoforge.core.policy_losses import POLICY_LOSSES
from ppoforge.errors import UserError
from ppoforge.lm.models.export_fields import export_dtype_param, export_param
from ppoforge.lm.rl.config_checks import RLHFChecks
from ppoforge.lm.rl.estimators import ESTIMATORS, Estimator
from ppoforge.runtime.device import check_device_name
from ppoforge.runtime.metrics import REPORT_TO_HELP, report_sinks
from ppoforge.runtime.precision import PRECISION_CHOICES
from ppoforge.runtime.resilience import FaultConfig

LAYOUTS = ("lora", "lora-critic", "full")  # see lm/models/layouts.py
SCORING_MODES = ("auto", "sampler", "recompute")  # see lm/rl/passes.py
# the stats a PPO update reports (lm/rl/update.py): loss stats weighted by the micro-batch's share of the loss
# units, the others by its share of the tokens; without a critic no value stats, `kl` with kl_in: loss only
LOSS_KEYS = ("loss/policy_avg", "loss/value_avg")
TOKEN_KEYS = ("policy/entropy_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/clipfrac_avg", "val/ratio",
              "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")
CRITIC_KEYS = ("loss/value_avg", "val/clipfrac_avg")
MAX_ROLLOUT_TOKENS = 2**26  # the model-specific memory check comes when the model is known (lm/rl/build.py)


@dataclass
class RLHFConfig(RLHFChecks, FaultConfig):
    preset_domain = "rlhf"  # its built-in presets: configs/rlhf/ (`from_preset`)
    # ---- models
    model: str = param("smollm2-135m-instruct", "policy model: a checkpoint dir, a hub id or a built-in name")
    tokenizer: str | None = param(None, "tokenizer folder or hub id (none: the model's own)")
    layout: str = param("lora", "lora: frozen base + adapters, reference = adapters off, value head on the "
                        "policy's trunk; lora-critic: the critic is a second adapter; full: TRL's 4 models",
                        choices=LAYOUTS)
    lora_r: int = param(16, "LoRA rank", lo=1, hi=4096)
    lora_alpha: float = param(32.0, "LoRA alpha (the update is scaled by alpha / r)", gt=0, hi=1e5)
    lora_target_modules: str = param("all-linear", "modules to adapt: all-linear or comma-separated names")
    export: str = export_param()
    export_dtype: str = export_dtype_param()
    fsdp: bool = param(False, "full layout under torchrun: shard policy, critic and reference over the ranks "
                       "with FSDP2 (each rank keeps 1/world of the weights and optimizer state); checkpoints "
                       "through torch.distributed.checkpoint, which resume on any world size")
    critic_model: str | None = param(None, "full layout: a reward model to start the critic from (its trunk "
                                     "and score head, as TRL does); default: the policy's trunk, zero head")
    # ---- data and reward
    prompts: str = param("demo", "prompt set: a .jsonl/.json/.csv/.parquet file, a datasets name, demo, or "
                         "task:NAME?KEY=VALUE&... (a reasoning-gym task, with --reward task)", data=True)
    prompt_field: str = param("prompt", "field of each row that holds the prompt: a text, or a list of {role, "
                              "content} messages (TRL's conversational prompts, rendered by the chat template)")
    heldout_prompts: str | None = param("auto", "prompts scored before and after training (eval/ metrics): a "
                                        "prompt set as for prompts; auto: demo-heldout with the demo prompts, "
                                        "else a held-out split of the prompts (heldout_fraction); none to skip",
                                        resume=True)
    heldout_fraction: float = param(0.05, "heldout_prompts auto with prompts other than demo: this share of the "
                                    "prompt rows (at least 1, at most 32, the same rows at every run and resume) "
                                    "is evaluated and never trained on; a set of fewer than 20 rows is not split "
                                    "(no held-out evaluation)", gt=0, hi=0.5)
    heldout_every: int = param(0, "also evaluate the held-out prompts every this many updates (0: before and "
                               "after training only)", lo=0, hi=10**9, resume=True)
    heldout_disjoint: bool = param(True, "leave every training prompt that is also a held-out prompt (the same "
                                   "text) out of training, so eval/ scores measure problems never trained on "
                                   "(without an env: an env's episodes differ by seed)")
    heldout_samples: int = param(4, "completions sampled per held-out prompt; eval/scores averages all of "
                                 "them (one sample of 16 prompts swung the mean by +-0.13 here)",
                                 lo=1, hi=4096, resume=True)
    use_chat_template: bool = param(True, "wrap prompts in the tokenizer's chat template when it has one")
    reward: str = param("vader", "reward spec, comma-separated: vader, length:N, format:REGEX, "
                        "eos_penalty:X, model:PATH (its own tokenizer, else the policy's), task (the checker of task: "
                        "prompts), py:module:function")
    reward_weights: str | None = param(None, "comma-separated weight per reward term (default: all 1)")
    reward_clip: float | None = param(100.0, "clip each score to +-this, counted in guard/rewards_clipped "
                                      "(none: off); a non-finite score skips the update (see reliability docs)",
                                      gt=0, hi=1e12)
    # ---- sampling
    max_prompt_tokens: int = param(128, "prompts longer than this keep their last tokens (one line says how many; "
                                   "data_report.json counts them)", lo=1, hi=1_000_000)
    max_new_tokens: int = param(32, "response length limit", lo=1, hi=1_000_000)
    temperature: float = param(0.7, "sampling temperature; log-probs use the same scaling", gt=0, hi=100.0)
    top_k: int = param(0, "sample from the k most likely tokens (0: off)", lo=0, hi=10_000_000)
    top_p: float = param(1.0, "nucleus sampling mass (1: off)", gt=0, hi=1.0)
    stop_tokens: str | None = param(None, "extra stop tokens besides EOS: comma-separated ids or tokens")
    # ---- PPO
    batch_size: int = param(16, "prompts per rollout (each sampled num_generations times)", lo=1, hi=1_000_000)
    mini_batch_size: int | None = param(None, "responses per optimizer step; none: the whole rollout (batch_size x "
                                        "num_generations: one step per epoch)", lo=1, hi=1_000_000)
    micro_batch_size: int | None = param(None, "responses per forward/backward (accumulated to a mini-batch); none: "
                                         "the largest divisor of mini_batch_size up to 8", lo=1, hi=1_000_000)
    ppo_epochs: int = param(4, "passes over each rollout", lo=1, hi=10_000)
    learning_rate: float = param(1e-4, "AdamW learning rate (full fine-tuning wants ~1e-6)", gt=0, hi=10.0)
    anneal_lr: bool = param(True, "decay the learning rate linearly to 0 over total_updates")
    gamma: float = param(1.0, "discount over response tokens (GAE, REINFORCE++)", lo=0.0, hi=1.0)
    lam: float = param(0.95, "GAE lambda", lo=0.0, hi=1.0)
    clip: float = param(0.2, "PPO ratio clip epsilon", gt=0, hi=100.0)
    value_clip: float | None = param(0.2, "clip values to old values +- this (none: no value clipping)", gt=0, hi=1e6)
    vf_coef: float = param(0.1, "value loss coefficient (gae)", lo=0.0, hi=1e4)
    ent_coef: float = param(0.0, "entropy bonus coefficient", lo=0.0, hi=1e4)
    kl_coef: float = param(0.05, "initial KL coefficient beta (0: no KL term and no reference pass)", lo=0.0, hi=1e4)
    kl_estimator: str = param("k1", "per-token KL estimator (in the reward or the loss: kl_in)", choices=KL_ESTIMATORS)
    kl_target: float | None = param(None, "adaptive KL: target KL per response (none: fixed beta)", gt=0, hi=1e6)
    kl_horizon: int = param(10000, "adaptive KL horizon in responses", lo=1, hi=10**12)
    old_logprobs: str = param("auto", "where old log-probs, values and the reference come from: sampler (the "
                              "decode loop's and the lean decoder's, as TRL uses the sampler's); recompute "
                              "(training forwards, one more per update); auto: the fast ones where a check on "
                              "the first rollout finds them bit-identical, else recomputed",
                              choices=SCORING_MODES, resume=True)
    whiten_rewards: bool = param(False, "whiten per-token rewards (mean kept) before GAE")
    max_grad_norm: float = param(1.0, "global gradient-norm clip", gt=0, hi=1e9)
    skip_flat_rollouts: bool = param(True, "a rollout whose advantages are all 0 (every group's scores agree) and "
                                     "whose loss has no other term (no critic, KL loss or entropy bonus) makes no "
                                     "optimizer step: Adam's momentum would keep moving the policy with no evidence")
    # ---- critic-free estimators (GRPO, RLOO, REINFORCE++) and their loss options (docs/rlhf.md)
    advantage: str = param("gae", "advantage estimator: gae (PPO, with a critic); critic-free: grpo and rloo "
                           "(each prompt's num_generations completions as baseline), reinforce_pp (REINFORCE++: "
                           "whitened reward-to-go), reinforce_pp_baseline (group-centered score, then that)",
                           choices=tuple(ESTIMATORS))
    num_generations: int = param(1, "completions sampled per prompt (G): a rollout is batch_size x G responses, "
                                 "each prompt's G in a row", lo=1, hi=65536)
    shared_prefix: str = param("auto", "a prompt's G completions decode from one prefill of it, and forwards over "
                               "a rollout run k consecutive sequences as one row of real tokens, the prompt "
                               "tokens they share (a group's prompt, a chat template's system header) once "
                               "(lm/models/rows.py), where the estimated work is lower; off: every sequence its "
                               "own prefill and padded row, TRL's", choices=("auto", "off"), resume=True)
    scale_rewards: str = param("auto", "grpo: divide advantages by each group's reward std (group), the batch's "
                               "(batch) or not at all (none: Dr. GRPO); rloo: whiten the advantages over the batch "
                               "(batch: TRL's normalize_advantages) or not (none); auto: group for grpo (batch when "
                               "the KL is in the reward), none for rloo", choices=("auto", *SCALES))
    loss_agg: str = param("auto", "how per-token losses make a mini-batch's loss: token_mean; "
                          "seq_mean_token_mean (mean of each response's token mean: GRPO's); seq_sum_norm (sum / "
                          "(responses x max_new_tokens): Dr. GRPO's); auto: seq_mean_token_mean with policy_loss "
                          "gspo (its eq. 5 counts each response once), else token_mean",
                          choices=("auto", *LOSS_AGGREGATIONS))
    kl_in: str = param("reward", "where the KL to the reference acts: reward (-beta KL_t in each token's reward, "
                       "PPO's) or loss (+beta KL_t aggregated like the policy loss, GRPO's)",
                       choices=("reward", "loss"))
    clip_high: float | None = param(None, "upper ratio clip 1 + this, DAPO's clip-higher (none: 1 + clip)",
                                    gt=0, hi=100.0)
    collapse_patience: int = param(3, "updates in a row with a sign of collapse (entropy 2x update 1's, 90% of "
                                   "completions at max_new_tokens, the reward fallen to a flat floor, every "
                                   "group's completions scored alike: runtime/resilience.py CollapseGuard) "
                                   "before collapse_action; 0: off",
                                   lo=0, hi=10_000, resume=True)
    collapse_action: str = param("stop", "then: stop (one line naming the signs, exit 1) or rollback (the last "
                                 "checkpoint, the learning rate x rollback_lr_factor)", choices=("stop", "rollback"),
                                 resume=True)
    policy_loss: str = param("ppo", "policy loss: ppo (each token's ratio clipped); gspo (each response's "
                             "length-normalized ratio clipped, GSPO's); cispo (REINFORCE with each token's ratio "
                             "capped at 1 + clip_high and detached as its weight, CISPO's); docs/rlhf.md",
                             choices=tuple(POLICY_LOSSES))
    # ---- DAPO's dynamic sampling and overlong shaping (core/dapo.py, lm/rl/dynamic.py, docs/rlhf.md)
    dynamic_sampling: bool = param(False, "drop each group whose num_generations scores all agree (advantage 0) "
                                   "and refill the batch with fresh prompts (DAPO); group estimators only")
    dynamic_sampling_tries: int = param(3, "dynamic_sampling: extra batches of prompts drawn per update at most; "
                                        "still short, the batch is topped up with dropped groups "
                                        "(dynamic/filled_groups)", lo=1, hi=1000)
    overlong_buffer: int = param(0, "DAPO's soft overlong penalty: over the last this many tokens of "
                                 "max_new_tokens the score falls linearly by up to overlong_penalty (0: off)",
                                 lo=0, hi=1_000_000)
    overlong_penalty: float = param(1.0, "the overlong penalty at max_new_tokens (verl's penalty_factor)",
                                    lo=0.0, hi=1e4)
    mask_truncated: bool = param(False, "no loss on completions that end without a stop token (DAPO's overlong "
                                 "filtering, TRL's mask_truncated_completions); they still count in their group")
    # ---- multi-turn episodes with an environment (lm/envs/protocol.py, lm/envs/episodes.py, docs/environments.md)
    env: str | None = param(None, "environment the policy talks with over several turns, one episode per "
                            "prompt row: py:module:Class, textarena:GAME, trl:module:Class or a built-in name "
                            "(guess_number); it scores the episodes (reward: env). none: single-turn prompts")
    max_turns: int = param(1, "env: policy turns per episode (max_new_tokens is per turn)", lo=1, hi=10_000)
    max_episode_tokens: int | None = param(None, "env: policy + environment tokens per episode after the prompt "
                                           "(none: every turn's max_new_tokens plus the replies')", lo=1, hi=10**7)
    max_env_tokens: int = param(128, "env: tokens per environment reply (longer: env_overflow)", lo=1, hi=10**7)
    env_overflow: str = param("truncate", "env: a reply over max_env_tokens is cut in the middle (truncate) or "
                              "ends the episode as a budget truncation (drop)", choices=("truncate", "drop"))
    end_check: str = param("warn", "env: compare each episode's tokens with the chat template's rendering of its "
                           "conversation: strict (a mismatch is an error), warn (counted in "
                           "env/template_mismatch), off", choices=("strict", "warn", "off"))
    # ---- run
    total_updates: int = param(100, "PPO updates (rollout + optimization) to run", lo=1, hi=10**9, resume=True)
    seed: int = param(1, "seed for sampling, data order and initialization", lo=0, hi=2**32 - 1)
    precision: str = param("auto", "auto: bf16 autocast where the device computes it natively (GPU >= sm80, CPU "
                           "with AMX or AVX512-BF16), else fp32; fp32; bf16 (autocast; CPU or CUDA); fp16 (CUDA, "
                           "with a GradScaler)", choices=PRECISION_CHOICES)
    lm_head_fp32: bool = param(False, "under bf16/fp16: the LM head (logits) of policy and reference in fp32, "
                               "in sampling and training alike (no rounding of the logits; SmolLM2: per-token "
                               "log-prob error to fp32 -29%, KL -24%) at the cost of the head's matmuls in fp32 "
                               "(a fifth of a 135M model's)")
    device: str = param("auto", "auto (cuda if visible, else cpu), cpu, cuda or cuda:N", resume=True)
    torch_threads: int | None = param(None, "torch intra-op threads (none: torch's default)",
                                      lo=1, hi=4096, resume=True)
    gradient_checkpointing: bool = param(False, "recompute activations in backward to save memory", resume=True)
    rollout_engine: str = param("auto", "what samples the rollouts: lean (our Llama/Qwen2 decode step); hf (the "
                                "model's own forward, any model); vllm (an in-process vLLM engine, weights synced "
                                "after each update: docs/rlhf.md, Rollout engines); auto: vllm on CUDA where it is "
                                "installed, else lean where it applies, else hf",
                                choices=("auto", "lean", "hf", "vllm"), resume=True)
    rollout_timeout: float | None = param(1800.0, "vllm: seconds the engine's start and each generation may take "
                                          "before the run is checkpointed and stopped (none: no limit)",
                                          lo=1e-3, hi=1e7, resume=True)
    sync_timeout: float | None = param(600.0, "vllm: seconds each weight sync into the engine may take (none: no "
                                       "limit)", lo=1e-3, hi=1e7, resume=True)
    vllm_gpu_memory_utilization: float = param(0.3, "vllm on CUDA: the share of GPU memory the engine may take "
                                               "(weights + KV cache); training uses the rest", lo=0.01, hi=0.99,
                                               resume=True)
    vllm_sleep: bool = param(True, "vllm on CUDA: the engine sleeps between rollouts (level 1 with LoRA, 2 with "
                             "full weights), freeing its KV cache for training", resume=True)
    vllm_lora_sync: str = param("auto", "vllm with a LoRA layout: adapter (the adapter alone, loaded by vLLM as a "
                                "LoRARequest at each sync); merged (the adapted weights pushed merged into the "
                                "base); auto: adapter on CUDA where vLLM can load it (plain LoRA), else merged "
                                "(on a CPU vLLM's LoRA kernels generate ~5x slower)",
                                choices=("auto", "adapter", "merged"), resume=True)
    vllm_is_correction: bool = param(False, "vllm: weight each token's policy loss by the truncated importance "
                                     "ratio min(exp(old_logp - vllm_logp), vllm_is_cap) (TRL's / verl's "
                                     "rollout correction); off: the recomputed old log-probs alone")
    vllm_is_cap: float = param(2.0, "vllm_is_correction's cap C", lo=1.0, hi=1e6)
    attn_implementation: str = param("auto", "attention of the training/scoring forwards: auto (on CPU eager, "
                                     "faster there at RLHF lengths, and sdpa where max_prompt_tokens + the "
                                     "completion budget > 512, as eager's memory grows with its square; the "
                                     "model's default elsewhere), eager, sdpa",
                                     choices=("auto", "eager", "sdpa"))
    checkpoint_every: int = param(25, "save a checkpoint every this many updates (and at the end)",
                                  lo=1, hi=10**9, resume=True)
    log_every: int = param(1, "log metrics and a completions table every this many updates",
                           lo=1, hi=10**9, resume=True)
    tensorboard: bool = param(True, "also write TensorBoard event files", resume=True)
    report_to: str = param("tensorboard", REPORT_TO_HELP, resume=True)
    progress: bool = param(True, "show a live progress bar", resume=True)

    @property
    def rollout_size(self) -> int:
        """Responses per rollout: batch_size prompts x num_generations completions each."""
        return self.batch_size * self.num_generations

    @property
    def episode_tokens(self) -> int:
        """Tokens after the prompt: max_new_tokens, or with an env the episode budget."""
        if not self.env:
            return self.max_new_tokens
        return self.max_episode_tokens or (self.max_turns * self.max_new_tokens
                                           + (self.max_turns - 1) * self.max_env_tokens)

    @property
    def estimator(self) -> Estimator:
        """The `advantage` estimator's record (lm/rl/estimators.py)."""
        return ESTIMATORS[self.advantage]

    @property
    def has_critic(self) -> bool:
        """Only GAE learns a value function; the critic-free estimators build no critic at all."""
        return self.estimator.critic

    @property
    def reward_scale(self) -> str:
        """`scale_rewards` resolved: auto is the estimator's default (group for grpo, TRL's; none for rloo, its
        paper's) — batch in place of group when the KL is in the reward, whose per-group std would be KL noise
        (see `_check_estimator`)."""
        if self.scale_rewards != "auto":
            return self.scale_rewards
        default = self.estimator.default_scale
        return "batch" if default == "group" and self.kl_in_reward else default

    @property
    def heldout_split(self) -> bool:
        """heldout_prompts auto with a prompt set other than the demo's: the held-out rows are a split of the
        prompts (`lm/data/prompts.py: split_heldout`), never another task's prompts."""
        return self.heldout_prompts == "auto" and self.prompts != "demo"

    @property
    def heldout_source(self) -> str | None:
        """The prompt set the held-out rows come from: heldout_prompts, auto resolved (demo-heldout with the demo
        prompts, else the prompts themselves, split); None without held-out evaluation."""
        if self.heldout_prompts != "auto":
            return self.heldout_prompts
        return self.prompts if self.heldout_split else "demo-heldout"

    @property
    def aggregation(self) -> str:
        """`loss_agg` resolved: auto is the policy loss's own — seq_mean_token_mean for gspo (GSPO's eq. 5 is a
        plain mean over responses of s_i A_i; token_mean would weigh each by its length), token_mean for ppo
        and cispo (PPO's, TRL's PPOTrainer's)."""
        if self.loss_agg != "auto":
            return self.loss_agg
        return "seq_mean_token_mean" if self.policy_loss == "gspo" else "token_mean"

    def notes(self) -> list[str]:
        """One line each on a choice that is allowed but departs from its method's definition; the run prints
        them once (`lm/rl/build.py`), as finalize runs again at every resume."""
        if self.policy_loss == "gspo" and self.aggregation != "seq_mean_token_mean":
            return [f"loss_agg: {self.loss_agg} with policy_loss gspo is not GSPO's objective (its eq. 5 averages "
                    "the responses, each counted once: loss_agg auto or seq_mean_token_mean)"]
        return []

    @property
    def kl_in_reward(self) -> bool:
        """The rewards carry -beta * KL_t (kl_in: reward with a reference pass)."""
        return self.kl_in == "reward" and self.kl_coef > 0

    @property
    def kl_loss(self) -> bool:
        """The loss carries beta * KL_t of the current policy (kl_in: loss with a reference pass), GRPO's."""
        return self.kl_in == "loss" and self.kl_coef > 0

    @property
    def loss_is_policy_gradient_only(self) -> bool:
        """The loss is the policy-gradient term alone: all-zero advantages make its gradient 0."""
        return not self.has_critic and not self.kl_loss and self.ent_coef == 0

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout, no critic, no KL in the rewards: the update's own forward is the
        sampling policy, so its detached log-probs are the old ones, exactly (ratio 1; TRL's GRPO does the
        same) and no rollout pass computes them."""
        return (self.old_logprobs == "auto" and not self.has_critic and self.ppo_epochs == 1
                and self.mini_batch_size == self.rollout_size and (self.kl_in == "loss" or self.kl_coef == 0))

    def prefix_sizes(self, world: int = 1, sharded: bool = False) -> tuple[int, ...]:
        """The shared-prefix unit sizes k >= 2 whose units (k consecutive rows of the rollout) tile every
        micro-batch and every rank's part: k divides micro_batch_size, and each of `world` ranks' rows of
        the rollout (its collect) and, `sharded` (FSDP), of each mini-batch; none with shared_prefix off."""
        if self.shared_prefix == "off":
            return ()
        tile = math.gcd(self.micro_batch_size, self.rollout_size // world,
                        self.mini_batch_size // world if sharded else self.mini_batch_size)
        return tuple(k for k in range(2, tile + 1) if tile % k == 0)

    @property
    def stat_keys(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(loss keys, token keys) an update reports: no critic, no value stats; `kl` with kl_in: loss only."""
        dropped = set() if self.has_critic else set(CRITIC_KEYS)
        if not self.kl_loss:
            dropped.add("kl")
        return tuple(k for k in LOSS_KEYS if k not in dropped), tuple(k for k in TOKEN_KEYS if k not in dropped)

    @property
    def curve_title(self) -> str:
        """The reward/KL plot's title, e.g. "PPO lora" or "GRPO lora, guess_number?hi=8 episodes"."""
        title = f"{self.estimator.title} {self.layout}"
        return f"{title}, {self.env} episodes" if self.env else title

    def finalize(self) -> None:
        report_sinks(self.report_to)
        check_device_name(self.device)
        if self.mini_batch_size is None:  # resolved once here, as micro_batch_size: config.yaml holds the numbers
            self.mini_batch_size = self.rollout_size
        if self.micro_batch_size is None:
            self.micro_batch_size = default_micro_batch(self.mini_batch_size)
        tokens = self.rollout_size * (self.max_prompt_tokens + self.episode_tokens)
        if tokens > MAX_ROLLOUT_TOKENS:
            raise UserError(f"batch_size: {self.batch_size} x num_generations {self.num_generations} x "
                            f"(max_prompt_tokens + {'episode' if self.env else 'max_new'}_tokens) = {tokens:,} "
                            f"tokens per rollout; allowed: <= {MAX_ROLLOUT_TOKENS:,}")
        self._check_env()
        rollout = (f"batch_size {self.batch_size}" if self.num_generations == 1 else
                   f"batch_size x num_generations = {self.rollout_size}")
        if self.rollout_size % self.mini_batch_size:
            raise UserError(f"mini_batch_size: {self.mini_batch_size} does not divide {rollout}; allowed: a "
                            "divisor of it")
        if self.mini_batch_size % self.micro_batch_size:
            raise UserError(f"micro_batch_size: {self.micro_batch_size} does not divide mini_batch_size "
                            f"{self.mini_batch_size}; allowed: a divisor of mini_batch_size")
        if self.critic_model is not None and self.layout != "full":
            raise UserError(f"critic_model: only the full layout has a separate critic model; allowed: none "
                            f"with layout {self.layout}")
        self._check_fsdp()
        self._check_estimator()
        self._check_dapo()

    @property
    def layout_decoder(self) -> str:
        """The layout's own decoder (the local engines', and the lean reference pass's): lean, hf or auto."""
        return self.rollout_engine if self.rollout_engine in ("lean", "hf") else "auto"
