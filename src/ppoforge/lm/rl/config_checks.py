"""The combinations of RLHFConfig's fields that cannot work, each refused in one line naming what is allowed
(`RLHFConfig.finalize` calls them once the defaults are resolved). A mixin: the checks read the config's own
fields and derived values (`estimator`, `has_critic`, `kl_in_reward`)."""

from __future__ import annotations

from ppoforge.errors import UserError
from ppoforge.lm.rl.estimators import ESTIMATORS, Estimator


class RLHFChecks:
    """RLHFConfig's cross-field checks (see the module docstring)."""

    def _check_fsdp(self) -> None:
        """FSDP2 shards the full layout's models and decodes with the lean decoder on gathered weights."""
        if not self.fsdp:
            return
        if self.layout != "full":
            raise UserError(f"fsdp: shards the full layout's models; layout {self.layout} trains adapters, which "
                            "plain data parallelism replicates; allowed: layout full, or fsdp false")
        if self.precision == "fp16":
            raise UserError("precision: fp16 is not supported with fsdp (its GradScaler would need a found-inf "
                            "all-reduce across ranks); allowed: fp32, bf16, auto")
        if self.rollout_engine == "hf":
            raise UserError("rollout_engine: hf with fsdp would run a collective per decoded token, and rows that "
                            "end at different steps on different ranks would hang it; allowed: auto, lean (fsdp "
                            "gathers the policy whole for the lean decoder) or vllm (each rank's engine synced "
                            "whole)")

    def _check_dapo(self) -> None:
        """Dynamic sampling needs a group baseline and single-turn batches; the overlong ramp fits the budget."""
        if self.dynamic_sampling and not self.estimator.groups:
            grouped = ", ".join(e.name for e in ESTIMATORS.values() if e.groups)
            raise UserError(f"dynamic_sampling: drops groups whose scores agree, which advantage {self.advantage} "
                            f"still learns from; allowed: false, or advantage {grouped}")
        for name, off in (("dynamic_sampling", False), ("overlong_buffer", 0)):
            if self.env and getattr(self, name) != off:
                raise UserError(f"{name}: applies to single-turn responses; allowed with env: {str(off).lower()}")
        if self.overlong_buffer >= self.max_new_tokens:
            raise UserError(f"overlong_buffer: {self.overlong_buffer} is not below max_new_tokens "
                            f"{self.max_new_tokens}; allowed: 0 (off) to {self.max_new_tokens - 1}")

    def _check_env(self) -> None:
        if not self.env:
            changed = [name for name, default in (("max_turns", 1), ("max_episode_tokens", None))
                       if getattr(self, name) != default]
            if changed or self.reward == "env":
                raise UserError(f"{(changed or ['reward'])[0]}: applies to multi-turn episodes; allowed without "
                                "env: its default (set env to an environment)")
            return
        if self.reward != "env":
            raise UserError(f"reward: {self.reward!r} with env {self.env!r}, which scores its own episodes; "
                            "allowed: env")

    def _check_scale(self, est: Estimator) -> None:
        """`scale_rewards` other than auto: one the estimator allows."""
        scale = self.scale_rewards
        if scale == "auto" or scale in est.scales:
            return
        if not est.scales:
            scaled = " and ".join(e.name for e in ESTIMATORS.values() if e.scales)
            raise UserError(f"scale_rewards: {scale} applies to {scaled}; allowed with advantage {est.name}: auto"
                            + (f" (it {est.scaling})" if est.scaling else ""))
        raise UserError(f"scale_rewards: {scale} does not apply to {est.name}, which {est.scaling}; allowed with "
                        f"advantage {est.name}: {', '.join(est.scales)}, auto")

    def _check_estimator(self) -> None:
        """Combinations of the advantage estimator, its KL and its critic that cannot work."""
        adv, est = self.advantage, self.estimator
        if est.groups and self.num_generations < 2:
            raise UserError(f"num_generations: {self.num_generations} with advantage {adv}, whose baseline is "
                            "the other completions of the same prompt; allowed: >= 2")
        self._check_scale(est)
        if self.scale_rewards == "group" and self.kl_in_reward:
            # a group whose scores all agree has a tiny but non-zero std of (score - beta * KL): its
            # advantages would be KL noise scaled to unit variance, a "no signal" group trained on noise
            raise UserError(f"scale_rewards: group with kl_in reward (kl_coef {self.kl_coef:g}) divides each group's "
                            "KL noise by its own tiny std; allowed: kl_in loss, scale_rewards batch or none, or "
                            "kl_coef 0")
        if not self.has_critic and self.layout == "lora-critic":
            raise UserError(f"layout: lora-critic trains a critic adapter, which advantage {adv} does not use; "
                            "allowed: lora or full")
        if not self.has_critic and self.critic_model is not None:
            critics = " or ".join(e.name for e in ESTIMATORS.values() if e.critic)
            raise UserError(f"critic_model: advantage {adv} has no critic; allowed: none (or advantage {critics})")
        if not self.has_critic and self.whiten_rewards:
            raise UserError(f"whiten_rewards: whitens GAE's per-token rewards; allowed with advantage {adv}: false")
        if self.kl_in == "loss" and self.kl_estimator == "k1" and self.kl_coef:
            raise UserError("kl_estimator: k1 as a loss term has zero expected gradient (E[grad log pi] = 0); "
                            "allowed with kl_in loss: k2 or k3")
        if self.kl_target is not None and not self.kl_coef:
            raise UserError("kl_target: the adaptive controller scales kl_coef, which is 0 (no reference pass); "
                            "allowed: none with kl_coef 0, or kl_coef > 0")
