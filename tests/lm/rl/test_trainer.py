"""RLHF PPO trainer on tiny random models: both layouts, exact ratios, accumulation invariance,
frozen weights, eval mode, exact resume after SIGTERM, and the `train rlhf` CLI."""

import json
import math
import os
import signal

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ppoforge.lm.models.logprobs as logprobs_module
from ppoforge.cli import main
from ppoforge.config import build_config
from ppoforge.lm.models.loading import load_causal_lm
from ppoforge.lm.models.parts import head_size
from ppoforge.lm.models.rows import padded
from ppoforge.lm.rl import build
from ppoforge.lm.rl.build import attention_for
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.trainer import RLHFTrainer, train
from ppoforge.runtime.metrics import read_metrics

PROMPTS = ["tell a story about the rain", "write one sentence about coffee", "describe the city at night",
           "a review of a good movie", "tell me about your friend", "the weather today is",
           "write about the sun", "describe my morning"]
TRL_METRICS = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
               "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg",
               "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/num_eos_tokens", "lr", "episode",
               "perf/samples_per_s", "perf/tokens_per_s", "perf/generation_share"]


def word_reward(prompts, completions, **kwargs):
    """More words and more 'great' is better: a cheap deterministic reward."""
    return [0.1 * len(c.split()) + c.count("great") for c in completions]


@pytest.fixture
def cfg_for(tiny_lm_dir, prompts_file):
    def make(**overrides):
        values = dict(model=str(tiny_lm_dir), prompts=str(prompts_file), heldout_prompts=None,
                      max_prompt_tokens=16, max_new_tokens=6, batch_size=4, mini_batch_size=4,
                      micro_batch_size=2, ppo_epochs=1, total_updates=2, learning_rate=1e-2, device="cpu",
                      seed=0, torch_threads=1, progress=False, tensorboard=False, precision="fp32")
        return build_config(RLHFConfig, {**values, **overrides})
    return make


def _grads(trainer):
    return {n: p.grad.detach().clone() for n, p in trainer.layout.named_trainable() if p.grad is not None}


def _snapshot(named):
    return {n: p.detach().clone() for n, p in named}


def _frozen(trainer):
    """(name, tensor) of weights that must never change: LoRA base weights, or the full reference."""
    layout = trainer.layout
    if trainer.cfg.layout != "full":
        return [(n, p) for n, p in layout.peft.named_parameters() if "lora_" not in n]
    return list(layout.reference.named_parameters())


@pytest.mark.parametrize("overrides", [
    dict(layout="lora"),
    # zero value head -> critic LoRA B -> critic LoRA A: gradients reach A from the third step on
    dict(layout="lora-critic", kl_estimator="k3", kl_target=0.01, kl_horizon=10, mini_batch_size=2),
    dict(layout="full", learning_rate=1e-3),
], ids=["lora", "lora-critic-adaptive-k3", "full"])
def test_layouts_train_change_trainables_only_and_export(cfg_for, tmp_path, overrides):
    cfg = cfg_for(heldout_prompts=None, tensorboard=True, **overrides)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=word_reward)
    trainable, frozen = _snapshot(trainer.layout.named_trainable()), _snapshot(_frozen(trainer))
    result = trainer.run()
    assert result.updates == 2 and result.stopped_by is None
    for name, p in trainer.layout.named_trainable():
        assert not torch.equal(p, trainable[name]), f"{name} did not train"
    for name, p in _frozen(trainer):
        assert torch.equal(p, frozen[name]), f"frozen {name} changed"

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in TRL_METRICS:
        assert all(isinstance(r[key], float | int) and math.isfinite(r[key]) for r in rows), key
    if cfg.kl_target:
        assert rows[1]["objective/kl_coef"] != rows[0]["objective/kl_coef"]
    table = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(table) == 8 and {"step", "prompt", "completion", "score"} <= set(table[0])
    assert (tmp_path / "reward_kl.png").is_file() and list((tmp_path / "tb").iterdir())

    # the export (`export: adapter`: the LoRA adapter alone in PEFT format; full: the model) loaded as a model
    # computes the trainer's policy logits
    files = {f.name for f in (tmp_path / "model").iterdir()}
    assert ("adapter_model.safetensors" in files) == (cfg.layout != "full") != ("model.safetensors" in files)
    exported = load_causal_lm(str(tmp_path / "model"), tokenizer=trainer.tokenizer)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trainer"] == "rlhf" and summary["steps"] == 2 and summary["unit"] == "update"
    assert summary["export"] == str(tmp_path / "model") and summary["stopped_by"] is None
    assert summary["objective/scores"] == pytest.approx(rows[-1]["objective/scores"])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    mask = torch.ones(1, 6)
    with torch.no_grad():
        ours = trainer.layout.logits(trainer.layout.forward(padded(ids, mask, 3))[0])
        theirs = exported(input_ids=ids).logits[:, -4:-1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["lora", "full"])
def test_modules_stay_in_eval_mode_with_dropout_off(cfg_for, tmp_path, layout):
    trainer = RLHFTrainer(cfg_for(layout=layout), tmp_path, reward_fn=word_reward)
    trainer.train_one_update()
    models = [trainer.layout.policy_model, trainer.layout.value_head]
    if layout == "full":
        models += [trainer.layout.reference, trainer.layout.critic]
    for model in models:
        assert not any(m.training for m in model.modules())
        assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def _fast_and_plain(trainer):
    """A fresh rollout's (old logp, values, ref logp) from the fast path and from training forwards."""
    gen = torch.Generator().manual_seed(0)
    ids, prompt_mask, samples = trainer.collector.generate(trainer.inputs.prompt_ids[:4], gen)
    mask = torch.cat([prompt_mask.float(), samples.response_mask], 1)
    sc = trainer.passes
    with torch.inference_mode(), trainer.precision.autocast():
        ref_fast = sc.layout.fast_ref_forward or sc.layout.ref_forward
        rows = sc.rows_for(ids, mask, samples.response_ids.shape[1])
        fast = (*sc._policy_fast(rows, samples), sc._reference(rows, samples, ref_fast))
        plain = (*sc._policy_plain(rows, samples), sc._reference(rows, samples, sc.layout.ref_forward))
    return fast, plain, samples


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["lora", "lora-critic", "full"])
def test_update_one_is_exactly_on_policy_and_at_the_reference(cfg_for, tmp_path, layout, precision, attn):
    """Before any update the policy is the sampler's and the reference: the first mini-batch's ratio is
    exactly 1 and the KL exactly 0, on every layout, precision and attention. `old_logprobs: auto` uses
    the fast path's numbers only where a check found them bit-identical to the training forward (else
    it recomputes them), and after an update (LoRA B != 0, value head != 0) that finding still holds."""
    cfg = cfg_for(layout=layout, precision=precision, attn_implementation=attn,
                  learning_rate=1e-3 if layout == "full" else 1e-2)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=word_reward)
    assert trainer.policy_attention() == attn and trainer.passes.fast_policy is None
    metrics, _ = trainer.train_one_update()  # 1 epoch, 1 mini-batch: the first forward sees the old policy
    assert metrics["val/ratio"] == 1 and metrics["policy/approxkl_avg"] == 0
    assert metrics["policy/clipfrac_avg"] == 0 and metrics["objective/kl"] == 0
    fast_policy, fast_ref = trainer.passes.fast_policy, trainer.passes.fast_reference
    assert fast_policy in (True, False) and fast_ref in (True, False)  # decided on the first rollout
    if precision == "bf16" and attn == "eager":  # where the kernels agree (torch 2.6 and 2.13 on CPU)
        assert fast_policy and fast_ref == (layout != "full")
    (logp, values, ref), (p_logp, p_values, p_ref), samples = _fast_and_plain(trainer)
    assert p_values.abs().max() > 0  # the value head trained: values are not trivially equal
    m = samples.response_mask
    if fast_policy:
        assert torch.equal(logp * m, p_logp * m) and torch.equal(values * m, p_values * m), "trusted, now off"
    if fast_ref:
        assert torch.equal(ref * m, p_ref * m)
    tol = {"atol": 1e-2 if precision == "bf16" else 1e-5, "rtol": 0}  # either way: the same policy
    for f, p in ((logp, p_logp), (values, p_values), (ref, p_ref)):
        torch.testing.assert_close(f * m, p * m, **tol)


def _update_recording_grads(trainer, monkeypatch):
    """One update: its metrics, the gradients its optimizer steps on, and how many head chunks were
    checkpointed."""
    calls, step, grads = [], trainer.optimizer.step, []

    def counted(*args, **kwargs):
        calls.append(1)
        return checkpoint(*args, **kwargs)

    def recorded():  # Adam's first step is ~lr * sign(grad): compare the gradients, not the weights
        grads.append(_grads(trainer))
        step()

    monkeypatch.setattr(logprobs_module, "checkpoint", counted)
    monkeypatch.setattr(trainer.optimizer, "step", recorded)
    metrics, _ = trainer.train_one_update()
    return metrics, grads, calls


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["lora", "lora-critic", "full"])
def test_the_lm_head_by_chunks_is_the_same_update(cfg_for, tmp_path, monkeypatch, layout, precision):
    """`head_logprobs` with the logits of a micro-batch split into chunks of 5 tokens (checkpointed: the
    backward recomputes them): update 1 is still exactly on policy and at the reference, and the update's
    losses and gradients are the unchunked run's."""
    runs = {}
    for chunked in (False, True):
        trainer = RLHFTrainer(cfg_for(layout=layout, precision=precision, old_logprobs="recompute",
                                      learning_rate=1e-3 if layout == "full" else 1e-2), tmp_path / str(chunked),
                              reward_fn=word_reward)
        vocab = head_size(trainer.layout.policy_model)
        monkeypatch.setattr(logprobs_module, "HEAD_CHUNK_ELEMENTS", 5 * vocab if chunked else 1 << 40)
        metrics, grads, calls = _update_recording_grads(trainer, monkeypatch)
        assert bool(calls) == chunked and len(grads) == 1
        runs[chunked] = metrics, grads[0]
    (metrics, grads), (plain, plain_grads) = runs[True], runs[False]
    assert metrics["val/ratio"] == 1 and metrics["policy/approxkl_avg"] == 0 and metrics["objective/kl"] == 0
    for key in ("loss/policy_avg", "policy/entropy_avg", "loss/value_avg"):
        if key in plain:
            assert metrics[key] == pytest.approx(plain[key], abs=1e-6), key
    assert grads.keys() == plain_grads.keys()
    for name, g in grads.items():
        if precision == "fp32":
            torch.testing.assert_close(g, plain_grads[name], atol=1e-6, rtol=1e-5)
        else:  # bf16 rounds each chunk's head-weight gradient (full layout) before the sum: equal to bf16 rounding
            assert (g - plain_grads[name]).norm() <= 2 ** -8 * plain_grads[name].norm(), name


@pytest.mark.parametrize("layout", ["lora", "full"])
def test_lm_head_fp32_under_bf16_keeps_update_one_exact(cfg_for, tmp_path, layout):
    """`lm_head_fp32`: the policy's logits are fp32 under bf16 autocast, the full layout's reference keeps
    its head in fp32 as the policy's (stored in bf16 it would compute another distribution), and update 1
    is still exactly on-policy and at the reference."""
    from ppoforge.lm.models.parts import head_computes_in_fp32

    cfg = cfg_for(layout=layout, precision="bf16", attn_implementation="eager", lm_head_fp32=True,
                  learning_rate=1e-3 if layout == "full" else 1e-2)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=word_reward)
    layout_ = trainer.layout
    assert head_computes_in_fp32(layout_.policy_model.get_output_embeddings())
    if layout == "full":
        ref_head = layout_.reference.lm.get_output_embeddings()
        assert head_computes_in_fp32(ref_head) and ref_head.weight.dtype == torch.float32
    with torch.no_grad(), trainer.precision.autocast():
        assert layout_.logits(torch.randn(2, 3, layout_.policy_model.config.hidden_size)).dtype == torch.float32
    metrics, _ = trainer.train_one_update()
    assert metrics["val/ratio"] == 1 and metrics["policy/approxkl_avg"] == 0 and metrics["objective/kl"] == 0


def test_auto_falls_back_to_recomputing_when_the_sampler_is_off(cfg_for, tmp_path, capsys):
    trainer = RLHFTrainer(cfg_for(precision="bf16"), tmp_path, reward_fn=word_reward)
    fast = trainer.passes._policy_fast
    trainer.passes._policy_fast = lambda *a: (lambda logp, v: (logp + 1e-4, v))(*fast(*a))
    metrics, _ = trainer.train_one_update()
    assert trainer.passes.fast_policy is False and trainer.passes.fast_reference is True
    assert metrics["val/ratio"] == 1 and metrics["objective/kl"] == 0
    err = capsys.readouterr().err
    line = ("ppoforge: info: on cpu / bf16 / eager attention the sampler's log-probs are not bit-identical to the "
            "training forward's (log-probs by up to 0.0001), so ppoforge is recomputing old log-probs with the "
            "training forward")
    assert err.count(line) == 1 and "warning" not in err.lower()  # one info line, not a warning
    trainer.train_one_update()
    assert "bit-identical" not in capsys.readouterr().err  # said once


@pytest.mark.parametrize("mode", ["sampler", "recompute"])
def test_old_logprobs_sampler_and_recompute_are_taken_as_asked(cfg_for, tmp_path, mode):
    trainer = RLHFTrainer(cfg_for(old_logprobs=mode), tmp_path, reward_fn=word_reward)
    calls = {"_policy_fast": 0, "_policy_plain": 0}
    for name in calls:
        method = getattr(trainer.passes, name)
        setattr(trainer.passes, name, lambda *a, name=name, method=method: calls.__setitem__(
            name, calls[name] + 1) or method(*a))
    trainer.train_one_update()
    chunks = trainer.cfg.rollout_size // trainer.cfg.micro_batch_size  # the passes run micro-batch chunks
    assert calls == ({"_policy_fast": chunks, "_policy_plain": 0} if mode == "sampler"
                     else {"_policy_fast": 0, "_policy_plain": chunks})
    assert trainer.passes.fast_reference == (mode == "sampler")


@pytest.mark.parametrize("decoder", ["lean", "hf"])
def test_decoder_choice(cfg_for, tmp_path, decoder):
    from ppoforge.lm.models.decoders import HFDecoder, LlamaDecoder

    trainer = RLHFTrainer(cfg_for(rollout_engine=decoder), tmp_path, reward_fn=word_reward)
    with trainer.layout.decoder() as d:
        assert isinstance(d, LlamaDecoder if decoder == "lean" else HFDecoder)
    assert (trainer.layout.fast_ref_forward is None) == (decoder == "hf")
    metrics, _ = trainer.train_one_update()
    assert metrics["val/ratio"] == 1 and metrics["objective/kl"] == 0


def test_attention_for_picks_eager_for_short_rows_on_cpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention_for("auto", cpu, build.EAGER_MAX_TOKENS) == "eager"
    assert attention_for("auto", cpu, build.EAGER_MAX_TOKENS + 1) == "sdpa"
    assert attention_for("auto", cuda, 64) is None  # the model's default
    assert attention_for("eager", cpu, 10**4) == "eager" and attention_for("sdpa", cpu, 8) == "sdpa"


@pytest.mark.parametrize("limit", [22, 21])
def test_auto_attention_follows_the_row_length(cfg_for, tmp_path, monkeypatch, limit):
    """max_prompt_tokens 16 + max_new_tokens 6 = 22 positions: eager up to the limit, SDPA past it, and
    either way update 1 is exactly on policy."""
    monkeypatch.setattr(build, "EAGER_MAX_TOKENS", limit)
    trainer = RLHFTrainer(cfg_for(attn_implementation="auto"), tmp_path, reward_fn=word_reward)
    assert trainer.policy_attention() == ("eager" if limit == 22 else "sdpa")
    metrics, _ = trainer.train_one_update()
    assert metrics["val/ratio"] == 1


def test_tokenizer_field_with_bare_model_and_reward_checkpoints(cfg_for, tmp_path, tiny_lm_dir,
                                                               tiny_reward_model_dir, split_checkpoint):
    model_dir, tok_dir = split_checkpoint(tiny_lm_dir, tmp_path / "policy")
    reward_dir, _ = split_checkpoint(tiny_reward_model_dir, tmp_path / "reward")
    cfg = cfg_for(model=str(model_dir), tokenizer=str(tok_dir), reward=f"model:{reward_dir}")
    trainer = RLHFTrainer(cfg, tmp_path / "run")
    assert trainer.tokenizer.chat_template  # the tokenizer folder's, with its chat template
    metrics, table = trainer.train_one_update()
    assert len(table) == 4 and all(isinstance(r["score"], float) and math.isfinite(r["score"]) for r in table)


def _grads_and_params_after_one_update(cfg, run_dir):
    """One update with plain SGD (Adam's first step is ~sign(g), which amplifies rounding)."""
    trainer = RLHFTrainer(cfg, run_dir, reward_fn=word_reward)
    trainer.optimizer = torch.optim.SGD(trainer.params, lr=0.1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B and the value head start at 0: give every trainable a gradient path
        for name, p in trainer.layout.named_trainable():
            if "lora_B" in name or name.startswith("value_head"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    captured = {}
    clip = trainer.precision.clip

    def capture(optimizer, params, max_grad_norm):  # the mini-batch's gradients, before the step
        captured.update({n: p.grad.clone() for n, p in trainer.layout.named_trainable() if p.grad is not None})
        return clip(optimizer, params, max_grad_norm)

    trainer.precision.clip = capture
    trainer.train_one_update()
    return captured, _snapshot(trainer.layout.named_trainable())


@pytest.mark.parametrize("layout", ["lora", "lora-critic", "full"])
def test_accumulation_invariance_and_gradient_checkpointing(cfg_for, tmp_path, layout):
    # micro-batch 8 x accumulation 1 == micro-batch 1 x accumulation 8 (== with activation recomputation)
    # ragged responses (90 of the ~630 tokens stop one): with equal lengths a per-micro-batch mean would pass too
    base = dict(layout=layout, batch_size=8, mini_batch_size=8, max_grad_norm=1e6, max_new_tokens=12,
                stop_tokens=",".join(map(str, range(10, 100))))
    g_big, p_big = _grads_and_params_after_one_update(cfg_for(micro_batch_size=8, **base), tmp_path / "a")
    g_small, p_small = _grads_and_params_after_one_update(cfg_for(micro_batch_size=1, **base), tmp_path / "b")
    g_ckpt, _ = _grads_and_params_after_one_update(
        cfg_for(micro_batch_size=2, gradient_checkpointing=True, **base), tmp_path / "c")
    assert g_big.keys() == g_small.keys() == g_ckpt.keys() and len(g_big) > 0
    assert all(g.abs().max() > 0 for g in g_big.values())  # the critic adapter's too
    for name in g_big:
        torch.testing.assert_close(g_small[name], g_big[name], atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(g_ckpt[name], g_big[name], atol=1e-6, rtol=1e-4, msg=name)
        torch.testing.assert_close(p_small[name], p_big[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("where", ["reward", "between"])
def test_resume_after_sigterm_matches_uninterrupted_run(cfg_for, tmp_path, where):
    """SIGTERM inside a reward call abandons that update at once (the checkpoint holds the one before);
    SIGTERM elsewhere (here: in the KL controller, after the rewards) finishes the update. Either way
    the resumed run equals the uninterrupted one."""
    cfg = cfg_for(total_updates=4, ppo_epochs=2, mini_batch_size=2, micro_batch_size=1, checkpoint_every=10)
    train(cfg, tmp_path / "full", reward_fn=word_reward)
    calls = []

    def reward_then_sigterm(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) == 2 and where == "reward":  # during update 2's reward call
            os.kill(os.getpid(), signal.SIGTERM)
        return word_reward(prompts, completions)

    trainer = RLHFTrainer(cfg, tmp_path / "split", reward_fn=reward_then_sigterm)
    if where == "between":
        update_kl = trainer.kl_ctl.update
        trainer.kl_ctl.update = lambda *a: (len(calls) == 2 and os.kill(os.getpid(), signal.SIGTERM), update_kl(*a))
    stopped = trainer.run()
    assert stopped.stopped_by == "SIGTERM" and stopped.updates == (1 if where == "reward" else 2)
    assert not (tmp_path / "split" / "model").exists()  # no export for an unfinished run
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["export"] is None
    resumed = train(cfg, tmp_path / "split", resume=True, reward_fn=word_reward)
    assert resumed.updates == 4

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    assert strip(read_metrics(tmp_path / "split" / "metrics.jsonl")) == \
        strip(read_metrics(tmp_path / "full" / "metrics.jsonl"))
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["trainable"]
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)["trainable"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cli(capsys, *args):
    code = main(["train", "rlhf", *args])
    err = capsys.readouterr().err.strip()
    return code, err


def test_cli_trains_and_resumes(tiny_lm_dir, prompts_file, tmp_path, capsys):
    run = tmp_path / "run"
    held = tmp_path / "heldout.jsonl"  # 2 of the training prompts and one other: those 2 leave training
    held.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [*PROMPTS[:2], "a poem about the sea"]))
    common = ["--model", str(tiny_lm_dir), "--prompts", str(prompts_file), "--reward", "length:4",
              "--heldout-prompts", str(held), "--heldout-every", "1", "--batch-size", "4", "--mini-batch-size", "4",
              "--micro-batch-size", "2", "--max-new-tokens", "4", "--progress", "false", "--tensorboard",
              "false"]
    code, err = _cli(capsys, "--preset", "tiny", "--total-updates", "2", "--run-dir", str(run), *common)
    assert code == 0, err
    assert "2 of 8 training prompts are also held-out prompts: left out of training (heldout_disjoint)" in err
    assert (run / "model" / "adapter_config.json").is_file()
    metrics = read_metrics(run / "metrics.jsonl")
    # held-out before training, after update 1 (heldout_every) and at the end
    assert [r["step"] for r in metrics if "eval/scores" in r] == [0, 1, 2]
    rows = list(map(json.loads, (run / "completions.jsonl").read_text().splitlines()))
    assert not {r["prompt"] for r in rows if r["split"] == "train"} & set(PROMPTS[:2])  # held out is held out
    # held-out: every prompt sampled heldout_samples (default 4) times; eval/scores is their mean, with the
    # mean's 95 % interval
    heldout = [r for r in rows if r["split"] == "heldout"]
    assert len(heldout) == 3 * 3 * 4
    before = [r for r in heldout if r["step"] == 0]
    assert sorted(r["sample"] for r in before) == sorted(list(range(4)) * 3)
    first = metrics[0]
    assert first["eval/scores"] == pytest.approx(sum(r["score"] for r in before) / len(before))
    assert first["eval/scores_lo"] <= first["eval/scores"] <= first["eval/scores_hi"]
    code, err = _cli(capsys, "--resume", str(run), "--total-updates", "3")
    assert code == 0, err
    assert read_metrics(run / "metrics.jsonl")[-2]["step"] == 3
    code, err = _cli(capsys, "--resume", str(run), "--total-updates", "4", "--heldout-prompts", "none")
    assert code == 2 and "heldout_prompts: this held-out set leaves 0 training prompts out of training where the " \
        "run left out 2" in err, err


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "preset: no built-in preset 'nope'"),
    (["--mini-batch-size", "3"], "mini_batch_size: 3 does not divide batch_size"),
    (["--layout", "both"], "layout: 'both' is not allowed"),
    (["--temperature", "0"], "temperature: 0.0 is out of range"),
    (["--model", "/no/such/model"], "model: no model at /no/such/model"),
    (["--critic-model", "/x", "--layout", "lora-critic"], "critic_model: only the full layout"),
    (["--rollout-engine", "fast"], "rollout_engine: 'fast' is not allowed; allowed: auto, lean, hf, vllm"),
    (["--resume", "/no/such/run"], "no config.yaml in run dir"),
])
def test_cli_errors_are_one_line_exit_2(capsys, tmp_path, args, message):
    run_dir = [] if "--resume" in args else ["--run-dir", str(tmp_path / "r")]
    code, err = _cli(capsys, *run_dir, *args)
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("enabled", [False, True])
def test_gradient_checkpointing_recomputes_layers_in_backward(tiny_lm_dir, enabled):
    from ppoforge.lm.models.layouts import build_lora
    from ppoforge.lm.models.loading import load_causal_lm

    layout = build_lora(load_causal_lm(str(tiny_lm_dir)), 4, 8, "all-linear", False, enabled)
    calls = []
    layout.policy_model.base_model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    hidden, values = layout.forward(padded(torch.randint(3, 50, (2, 8)), torch.ones(2, 8), 4))
    (layout.logits(hidden).sum() + values.sum()).backward()
    assert len(calls) == (2 if enabled else 1)
    assert all(not m.training for m in layout.policy_model.base_model.layers[0].modules()
               if m is not layout.policy_model.base_model.layers[0])  # only the layer's own flag is set


def test_eos_penalty_reward_sees_which_completions_ran_out(cfg_for, tmp_path):
    trainer = RLHFTrainer(cfg_for(reward="eos_penalty:2.5", max_new_tokens=2), tmp_path)
    _, table = trainer.train_one_update()  # 2 new tokens: almost every completion runs out
    assert {r["score"] for r in table} <= {0.0, -2.5} and any(r["score"] == -2.5 for r in table)


def test_a_prompt_longer_than_max_prompt_tokens_is_cut_with_one_line_and_counted(cfg_for, tmp_path, capfd):
    # the prompts file's longest prompts tokenize to more than 4 tokens: each keeps its last 4, never silently
    cfg = cfg_for(max_prompt_tokens=4, total_updates=1)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=word_reward)
    err = capfd.readouterr().err
    whole = build.tokenize_prompts(trainer.inputs.tokenizer, trainer.inputs.prompt_rows, "prompt",
                                   cfg.use_chat_template, 10**6)
    lengths = [len(ids) for ids in whole]
    over = [n - 4 for n in lengths if n > 4]
    assert over and [ids[-4:] for ids in whole] == trainer.inputs.prompt_ids
    line = [x for x in err.splitlines() if "max_prompt_tokens 4" in x]
    assert len(line) == 1 and f"{len(over)} of {len(lengths)} prompts" in line[0]
    assert f"first {sum(over)} tokens" in line[0] and f"max_prompt_tokens {4 + max(over)}" in line[0]
    trainer.run()
    report = json.loads((tmp_path / "data_report.json").read_text())
    assert report["cut_to_max_prompt_tokens"]["prompts"] == {
        "rows": len(lengths), "cut_rows": len(over), "cut_tokens": sum(over), "longest": max(lengths),
        "max_prompt_tokens": 4, "estimated_rows": 0}


def test_prompts_within_max_prompt_tokens_say_nothing(cfg_for, tmp_path, capfd):
    trainer = RLHFTrainer(cfg_for(max_prompt_tokens=64), tmp_path, reward_fn=word_reward)
    assert "max_prompt_tokens" not in capfd.readouterr().err
    assert trainer.inputs.cuts["prompts"]["cut_rows"] == 0


@pytest.mark.parametrize("overrides", [
    dict(layout="lora", kl_coef=0.05, old_logprobs="recompute"),              # policy, values, reference passes
    dict(layout="full", learning_rate=1e-3, kl_coef=0.05, old_logprobs="auto"),
    dict(layout="lora", advantage="grpo", num_generations=4, kl_coef=0.05, kl_in="loss", kl_estimator="k3",
         shared_prefix="auto"),
], ids=["lora-ppo", "full-ppo-auto", "grpo-shared-prefix"])
def test_scoring_passes_run_in_micro_batch_chunks_with_the_same_numbers(cfg_for, tmp_path, overrides):
    """No scoring forward sees more rollout rows than the micro-batch (memory bounded by it, not the rollout);
    the chunked passes give the whole rollout's numbers."""
    grpo = "num_generations" in overrides
    cfg = cfg_for(batch_size=4 if grpo else 8, mini_batch_size=16 if grpo else 8, micro_batch_size=4, **overrides)
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=word_reward)
    seen = []
    rows_for = trainer.passes.rows_for
    trainer.passes.rows_for = lambda ids, mask, n: seen.append(ids.shape[0]) or rows_for(ids, mask, n)
    batch = trainer.collect(trainer.next_prompts())
    chunked = trainer.logprobs_and_values(batch, torch.zeros(cfg.rollout_size))
    assert seen and max(seen) <= 4 and sum(seen) >= cfg.rollout_size
    trainer.passes.chunk_rows = cfg.rollout_size  # the whole rollout in one pass, as before
    seen.clear()
    whole = trainer.logprobs_and_values(batch, torch.zeros(cfg.rollout_size))
    assert seen == [cfg.rollout_size] or seen == [cfg.rollout_size] * 2
    for name in ("logp", "values", "ref_logp"):
        a, b = getattr(chunked, name), getattr(whole, name)
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("new_shape", [True, False])
def test_old_logprobs_auto_is_checked_again_when_the_rollouts_shape_class_changes(cfg_for, tmp_path, capfd,
                                                                                new_shape):
    """A fast path found exact on update 1 drifts later: a rollout of a new shape class (here a chunk halved,
    as after an out-of-memory) checks again and switches to recompute, with the line; the same class does not
    pay the check again."""
    trainer = RLHFTrainer(cfg_for(old_logprobs="auto", kl_coef=0.0), tmp_path, reward_fn=word_reward)
    passes = trainer.passes
    plain = passes._policy_plain
    passes._policy_fast = lambda rows, samples: plain(rows, samples)  # update 1: the fast path is exact
    trainer.train_one_update()
    assert passes.fast_policy is True
    capfd.readouterr()
    passes._policy_fast = lambda rows, samples: (plain(rows, samples)[0] + 1e-3, plain(rows, samples)[1])  # drift
    if new_shape:
        passes.chunk_rows //= 2
    trainer.train_one_update()
    assert passes.fast_policy is (not new_shape)
    err = capfd.readouterr().err
    assert ("not bit-identical to the training forward's (log-probs by up to 0.001" in err) == new_shape


def _decoder_run(cfg_for, path, monkeypatch, share: bool) -> tuple[int, int, list[str]]:
    """One update with the lean decoder sharing the frozen base (or not): (bytes the model and the decoder
    hold, each storage once by data_ptr; the model's own bytes; the completions)."""
    from ppoforge.lm.models import decoders

    real = decoders.LlamaDecoder.__init__
    monkeypatch.setattr(decoders.LlamaDecoder, "__init__",
                        lambda self, *a, **k: real(self, *a, **{**k, "share_frozen": share and k.get("share_frozen")}))
    monkeypatch.setattr(decoders.LlamaDecoder, "in_place", share)  # the control stacks: a copy
    trainer = RLHFTrainer(cfg_for(lora_r=2, total_updates=1, kl_coef=0.0), path, reward_fn=word_reward)
    monkeypatch.setattr(decoders.LlamaDecoder, "__init__", real)
    peft = trainer.layout.peft
    model = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in [*peft.parameters(),
                                                                                      *peft.buffers()]}
    adapters = _snapshot(trainer.layout.named_trainable())
    _, rows = trainer.train_one_update()
    assert any(not torch.equal(p, adapters[n]) for n, p in trainer.layout.named_trainable())  # it trained
    stacks = [w for layer in trainer.layout._lean.layers for name in decoders.LINEARS
              for w in _flat(getattr(layer, name))]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*peft.parameters(), *peft.buffers(), *stacks]}
    return sum(held.values()), sum(model.values()), [r["completion"] for r in rows]


def test_the_lora_decoder_reads_the_models_own_frozen_weights(cfg_for, tmp_path, monkeypatch):
    """Without oneDNN packing (a GPU's path) the lean decoder's stacked q/k/v and gate/up are the model's own
    storage: the model and the decoder hold the model's bytes; the control (no sharing) holds the stacks
    twice. The samples are the same either way."""
    from ppoforge.lm.models import prepared

    monkeypatch.setattr(prepared, "packs", lambda dtype, device: False)
    shared, model, rows = _decoder_run(cfg_for, tmp_path / "shared", monkeypatch, True)
    copied, model_again, rows_again = _decoder_run(cfg_for, tmp_path / "copied", monkeypatch, False)
    assert shared <= 1.05 * model and copied > 1.3 * model_again, (shared, model, copied)
    assert rows == rows_again


def test_the_full_layouts_decoder_reads_the_models_own_weights(cfg_for, tmp_path, monkeypatch):
    """Without oneDNN packing (a GPU's path) and in the weights' own dtype, the full layout's per-rollout
    decoder holds no copy of the trained weights: q/k/v and gate/up are read as the model's own tensors, not
    stacked (before: the stacks, ~85 % of the layers' bytes, again). Its samples are the packed path's."""
    from ppoforge.lm.models import decoders, prepared

    def run(path, pack: bool):
        held = []
        real = decoders.LlamaDecoder._prepare_weights

        def spy(self, dtype, device):
            real(self, dtype, device)
            parts = [t for layer in self.layers for name in decoders.LINEARS for t in _flat(getattr(layer, name))]
            held.append({} if pack else {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in parts})

        with monkeypatch.context() as m:
            m.setattr(decoders.LlamaDecoder, "_prepare_weights", spy)
            if not pack:
                m.setattr(prepared, "packs", lambda dtype, device: False)
            trainer = RLHFTrainer(cfg_for(layout="full", total_updates=1, kl_coef=0.0), path, reward_fn=word_reward)
            model = {p.untyped_storage().data_ptr() for p in trainer.layout.policy_model.parameters()}
            layers = sum(p.numel() * p.element_size() for n, p in trainer.layout.policy_model.named_parameters()
                         if ".layers." in n)
            _, rows = trainer.train_one_update()
        assert held  # the rollout's decoder prepared its weights
        return sum(n for ptr, n in held[-1].items() if ptr not in model) / layers, [r["completion"] for r in rows]

    own, rows = run(tmp_path / "views", pack=False)
    _, rows_packed = run(tmp_path / "packed", pack=True)  # CPU: oneDNN's reordered copy (its speed-up)
    with monkeypatch.context() as m:  # the control: stacked, a copy of most of the layers' bytes
        m.setattr(decoders.LlamaDecoder, "in_place", False)
        stacked, rows_stacked = run(tmp_path / "stacked", pack=False)
    assert own == 0.0 and stacked > 0.5, (own, stacked)
    assert rows == rows_packed == rows_stacked


def _flat(value):
    """The tensors of a prepared linear: (weight, bias) or ((parts...), None)."""
    for item in value:
        if isinstance(item, tuple):
            yield from _flat(item)
        elif item is not None:
            yield item


def test_a_lora_run_whose_decoder_shares_the_base_exports_and_resumes(cfg_for, tmp_path, monkeypatch):
    from ppoforge.lm.models import prepared

    monkeypatch.setattr(prepared, "packs", lambda dtype, device: False)  # the GPU path: the model reads the stacks
    result = train(cfg_for(total_updates=2, checkpoint_every=1), tmp_path)
    assert result.updates == 2 and result.export == tmp_path / "model"
    assert load_causal_lm(str(result.export)) is not None


@pytest.mark.parametrize("max_grad_norm", [1e9, 1e-3], ids=["unclipped", "clipped"])
def test_grad_norm_is_the_step_gradients_norm_before_the_clip(cfg_for, tmp_path, max_grad_norm):
    """`policy/grad_norm` (TRL's grad_norm) is the global norm of the step's gradients before clipping:
    one mini-batch, so the gradients left in .grad after the update are that step's, clipped to the cap."""
    trainer = RLHFTrainer(cfg_for(max_grad_norm=max_grad_norm), tmp_path, reward_fn=word_reward)
    metrics, _ = trainer.train_one_update()
    left = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in _grads(trainer).values()]))
    assert metrics["policy/grad_norm"] > 1e-3
    assert left.item() == pytest.approx(min(metrics["policy/grad_norm"], max_grad_norm), rel=1e-4)
