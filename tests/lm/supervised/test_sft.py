"""`train sft` and `train reward` on tiny models: they learn, resume exactly, and what they export is
what `train rlhf` takes (a policy; a reward model as the reward and as the critic)."""

import json
import os
import signal

import pytest
import torch

from ppoforge.cli import main
from ppoforge.config import build_config
from ppoforge.lm.supervised.config import RewardConfig, SFTConfig

WORDS_POS = ["great", "wonderful", "excellent", "happy", "love", "amazing", "best", "perfect"]
WORDS_NEG = ["terrible", "awful", "sad", "hate", "boring", "horrible", "worst", "ugly"]
TOPICS = ["the movie", "the coffee", "the weather", "the city", "my morning", "the book", "the food", "the train"]


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    rows = [{"prompt": f"tell me about {t}", "completion": f"{t} is {w}"} for t in TOPICS for w in WORDS_POS[:4]]
    rows += [{"messages": [{"role": "user", "content": f"describe {t}"},
                           {"role": "assistant", "content": f"it is {w}"}]} for t in TOPICS for w in WORDS_POS[4:]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    """Separable preferences: the chosen completion has a positive word, the rejected one a negative word."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    rows = [{"prompt": f"tell me about {t}", "chosen": f"it is {p}", "rejected": f"it is {n}"}
            for t in TOPICS for p, n in zip(WORDS_POS, WORDS_NEG, strict=True)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sft_cfg(model, data, **kw):
    values = dict(model=str(model), data=str(data), layout="lora", lora_r=4, max_length=64, batch_size=8,
                  micro_batch_size=4, epochs=3, learning_rate=2e-2, eval_every=4, eval_fraction=0.25,
                  torch_threads=1, progress=False, tensorboard=False, device="cpu", sample_prompts=2,
                  sample_tokens=4, precision="fp32")  # fp32: the same on every CI CPU (auto is bf16 on some)
    return build_config(SFTConfig, {**values, **kw})


@pytest.mark.parametrize(("layout", "lr", "packing"), [("full", 3e-3, False), ("full", 3e-3, True),
                                                       ("lora", 2e-2, False)])
def test_sft_learns_and_exports_a_policy_rlhf_takes(tmp_path, tiny_lm_dir, sft_file, layout, lr, packing):
    from ppoforge.lm.supervised.sft import train

    result = train(_sft_cfg(tiny_lm_dir, sft_file, packing=packing, layout=layout, learning_rate=lr), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert evals[-1] < evals[0] * (0.8 if layout == "full" else 0.95), evals  # held-out loss fell
    assert result["stopped_by"] is None and (tmp_path / "run" / "samples.jsonl").is_file()
    export = tmp_path / "run" / "model"
    weights = "config.json" if layout == "full" else "adapter_config.json"  # lora: the adapter (`export: adapter`)
    assert (export / weights).is_file() and (export / "tokenizer_config.json").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["trainer"] == "sft" and summary["unit"] == "step" and summary["export"] == str(export)
    assert summary["steps"] == result["steps"] and summary["eval/loss"] == pytest.approx(evals[-1])
    # train rlhf --model takes the export (an adapter: its base with the adapter merged)
    code = main(["train", "rlhf", "--model", str(export), "--prompts", "demo", "--heldout-prompts", "none",
                 "--reward", "length:3", "--batch-size", "2", "--mini-batch-size", "2", "--micro-batch-size", "2",
                 "--max-new-tokens", "3", "--total-updates", "1", "--progress", "false", "--tensorboard", "false",
                 "--run-dir", str(tmp_path / "rlhf")])
    assert code == 0


def test_sft_resume_after_sigterm_equals_the_uninterrupted_run(tmp_path, tiny_lm_dir, sft_file):
    from ppoforge.lm.supervised import sft

    cfg = _sft_cfg(tiny_lm_dir, sft_file, epochs=2, checkpoint_every=100)
    sft.train(cfg, tmp_path / "full")
    trainer = sft.SupervisedTrainer(cfg, tmp_path / "split", sft.SFTObjective(cfg, tmp_path / "split"))
    loss = trainer.objective.loss

    def loss_then_sigterm(items):
        if trainer.update == 3 and not hasattr(trainer, "_sent"):
            trainer._sent = os.kill(os.getpid(), signal.SIGTERM) or True
        return loss(items)

    trainer.objective.loss = loss_then_sigterm
    stopped = trainer.run()
    assert stopped["stopped_by"] == "SIGTERM" and stopped["steps"] == 4
    sft.train(cfg, tmp_path / "split", resume=True)
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["trainable"]
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)["trainable"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_cli_reports_left_out_rows(tmp_path, tiny_lm_dir, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "completion": "there"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    code = main(["train", "sft", "--preset", "tiny", "--model", str(tiny_lm_dir), "--data", str(data),
                 "--eval-fraction", "0", "--progress", "false", "--tensorboard", "false",
                 "--run-dir", str(tmp_path / "r")])
    captured = capsys.readouterr()
    assert code == 0 and "1 rows used, 1 left out: 1 missing_field (first: line 2" in captured.err
    report = json.loads((tmp_path / "r" / "data_report.json").read_text())
    assert report[0]["left_out"] == {"missing_field": 1}
    code = main(["train", "sft", "--preset", "tiny", "--model", str(tiny_lm_dir), "--data", str(data), "--strict",
                 "true", "--run-dir", str(tmp_path / "r2")])
    assert code == 2 and "line 2" in capsys.readouterr().err


def test_a_run_refused_for_its_data_is_one_line_and_the_fixed_retry_reuses_its_run_dir(tmp_path, tiny_lm_dir,
                                                                                        capsys):
    data, run = tmp_path / "d.jsonl", tmp_path / "r"
    argv = ["train", "sft", "--preset", "tiny", "--model", str(tiny_lm_dir), "--data", str(data), "--eval-fraction",
            "0", "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)]
    data.write_text('{"messages": ' + "[" * 50_000 + "]" * 50_000 + "}\n")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ppoforge: error: data: file ") and "line 1 nests deeper than" in err and "\n" not in err
    chat = [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "1 bad_role (first: line 1, messages message 0 has role 'human'; allowed: system, user" in err
    assert (run / "data_report.json").is_file() and not (run / "config.yaml").exists()
    chat[0]["role"] = "user"
    data.write_text(json.dumps({"messages": chat}) + "\n")
    assert main(argv) == 0, capsys.readouterr().err  # nothing had started in the run dir: it is reused
    assert (run / "model").is_dir()


def _rm_cfg(model, data, **kw):
    values = dict(model=str(model), data=str(data), layout="full", max_length=64, batch_size=16,
                  micro_batch_size=8, epochs=6, learning_rate=2e-3, eval_every=6, eval_fraction=0.25,
                  torch_threads=1, progress=False, tensorboard=False, device="cpu", precision="fp32")
    return build_config(RewardConfig, {**values, **kw})


@pytest.mark.slow
def test_reward_model_separates_a_toy_set_and_serves_as_reward_and_critic(tmp_path, tiny_reward_model_dir,
                                                                          tiny_lm_dir, pairs_file):
    from ppoforge.lm.supervised import reward_model

    result = reward_model.train(_rm_cfg(tiny_reward_model_dir, pairs_file), tmp_path / "rm")
    assert result["eval/accuracy"] >= 0.95 and result["eval/gap"] > 0, result
    assert (tmp_path / "rm" / "reward_gaps.png").is_file()
    export = tmp_path / "rm" / "model"
    # as PPO's reward: it scores positive completions above negative ones
    from ppoforge.lm.rl.rewards import build_reward

    reward = build_reward(f"model:{export}")
    good, bad = reward(["tell me about the book"] * 2, ["it is wonderful", "it is awful"])
    assert good > bad
    # as PPO's critic (full layout): the value head is the trained score head
    code = main(["train", "rlhf", "--model", str(tiny_lm_dir), "--layout", "full", "--critic-model", str(export),
                 "--reward", f"model:{export}", "--prompts", "demo", "--heldout-prompts", "none", "--batch-size", "2",
                 "--mini-batch-size", "2", "--micro-batch-size", "2", "--max-new-tokens", "3", "--total-updates",
                 "1", "--learning-rate", "1e-5", "--progress", "false", "--tensorboard", "false",
                 "--run-dir", str(tmp_path / "rlhf")])
    assert code == 0


@pytest.mark.parametrize("layout", ["lora", "full"])
def test_reward_model_trains_with_lora_or_full_and_the_margin(tmp_path, tiny_reward_model_dir, pairs_file, layout):
    from ppoforge.lm.supervised import reward_model

    cfg = _rm_cfg(tiny_reward_model_dir, pairs_file, layout=layout, epochs=1, center_coef=0.01,
                  learning_rate=5e-3 if layout == "lora" else 1e-3)
    trainer = reward_model.SupervisedTrainer(cfg, tmp_path, reward_model.RewardObjective(cfg, tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.objective.trainable()}
    metrics = trainer.train_one_update()
    assert metrics["train/loss"] > 0 and 0 <= metrics["train/accuracy"] <= 1
    changed = [n for n, p in trainer.objective.trainable() if not torch.equal(p, before[n])]
    assert changed and (layout == "full" or all("lora_" in n or "modules_to_save" in n for n in changed))
    if layout == "lora":
        assert any("score" in n for n in changed)  # the score head trains too
    # the export (lora: the adapter and its score head, PEFT format) scores as the trained model does
    from ppoforge.lm.models.loading import load_reward_model

    trainer.objective.export(tmp_path / "model")
    assert (tmp_path / "model" / ("adapter_config.json" if layout == "lora" else "config.json")).is_file()
    exported = load_reward_model(str(tmp_path / "model"), tokenizer=trainer.objective.tokenizer)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, trainer.objective.model(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def _target_logprobs_alone(objective, items):
    return torch.cat([objective._target_logprobs([row]) for row in items])


def test_sft_batches_without_a_padding_mask_score_every_example_as_it_scores_alone(tmp_path, tiny_lm_dir, sft_file):
    """Unpacked right-padded rows run with the causal mask only; the padding after a row's tokens must not
    change its log-probs (nor may the rows' order within a micro-batch)."""
    from ppoforge.lm.supervised.sft import SFTObjective

    objective = SFTObjective(_sft_cfg(tiny_lm_dir, sft_file, layout="full"), tmp_path)
    items = sorted(objective.train_items, key=objective.size)[::5][:6]  # different lengths in one batch
    assert len({objective.size(row) for row in items}) > 1
    with torch.no_grad():
        torch.testing.assert_close(objective._target_logprobs(items), _target_logprobs_alone(objective, items),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["full", "lora"])
def test_sft_loss_through_the_lm_head_by_chunks_is_the_whole_heads(tmp_path, tiny_lm_dir, sft_file, monkeypatch,
                                                                   layout):
    """The LM head applied 7 target tokens at a time (checkpointed) gives the loss and every gradient of the
    head applied at once."""
    import ppoforge.lm.models.logprobs as logprobs_module
    from ppoforge.lm.supervised.sft import SFTObjective

    objective = SFTObjective(_sft_cfg(tiny_lm_dir, sft_file, layout=layout, packing=True), tmp_path)
    items = objective.train_items[:4]
    out = {}
    for tokens_per_chunk in (7, 1 << 30):
        monkeypatch.setattr(logprobs_module, "HEAD_CHUNK_ELEMENTS", tokens_per_chunk * objective.vocab)
        loss, _ = objective.loss(items)
        params = [p for _, p in objective.trainable()]
        out[tokens_per_chunk] = loss.detach(), torch.autograd.grad(loss, params)
    (loss, grads), (whole_loss, whole_grads) = out[7], out[1 << 30]
    assert objective.units(items) > 7 * 3  # several chunks
    torch.testing.assert_close(loss, whole_loss, atol=1e-6, rtol=1e-6)
    for g, w in zip(grads, whole_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_causal_reward_model_batches_score_each_pair_as_alone(tmp_path, tiny_reward_model_dir, pairs_file):
    from ppoforge.lm.models.loading import is_causal
    from ppoforge.lm.supervised.reward_model import RewardObjective

    assert is_causal("qwen2") and is_causal("llama") and not is_causal("bert") and not is_causal("distilbert")
    objective = RewardObjective(_rm_cfg(tiny_reward_model_dir, pairs_file), tmp_path)
    assert objective.causal
    items = objective.train_items[:6]
    items[0] = type(items[0])(items[0].chosen + items[0].chosen, items[0].rejected)  # a longer row pads the rest
    with torch.no_grad():
        batch = torch.stack(objective.rewards(items))
        alone = torch.stack([torch.cat(objective.rewards([p])) for p in items], dim=1)
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["full", "lora"])
def test_a_pair_as_one_row_scores_and_trains_exactly_as_two_padded_rows(tmp_path, tiny_reward_model_dir, pairs_file,
                                                                         layout):
    """shared_prefix auto (the prompt once, chosen and rejected behind it under a tree mask) against off
    (two right-padded rows): the same rewards, loss and gradients to fp32 rounding."""
    from ppoforge.lm.supervised.reward_model import RewardObjective

    results = {}
    for mode in ("auto", "off"):
        torch.manual_seed(0)  # the LoRA init
        objective = RewardObjective(_rm_cfg(tiny_reward_model_dir, pairs_file, layout=layout, shared_prefix=mode),
                                    tmp_path / mode)
        assert objective.branched == (mode == "auto")
        items = objective.train_items[:5]
        items[0] = type(items[0])(items[0].chosen + items[0].chosen[-3:], items[0].rejected)  # uneven sides
        loss, _ = objective.loss(items)
        loss.backward()
        results[mode] = (torch.stack(objective.rewards(items)).detach(), loss.detach(),
                         {n: p.grad.clone() for n, p in objective.trainable()})
    sizes = [objective.size(p) for p in items]  # off: the longer side; auto: both behind one prompt
    assert all(s < len(p.chosen) + len(p.rejected) for s, p in zip(sizes, items, strict=True))
    (r_auto, l_auto, g_auto), (r_off, l_off, g_off) = results["auto"], results["off"]
    torch.testing.assert_close(r_auto, r_off, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(l_auto, l_off, atol=1e-6, rtol=1e-6)
    assert g_auto.keys() == g_off.keys() and g_auto
    for n in g_auto:
        torch.testing.assert_close(g_auto[n], g_off[n], atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_the_all_reduce_layout_is_the_objectives_stat_keys_not_the_first_batchs(tmp_path, tiny_lm_dir,
                                                                                tiny_reward_model_dir, sft_file,
                                                                                pairs_file, monkeypatch, kind):
    """Under torchrun a rank whose first step holds no items (a resume into an epoch's partial last batch)
    has no stats: its flat all-reduce must still be as long as the others' (gloo errors on a length
    mismatch, NCCL is undefined). The layout is the objective's declared `stat_keys`, which its loss returns."""
    from ppoforge.lm.supervised import reward_model, sft
    from ppoforge.runtime import distributed

    if kind == "sft":
        cfg = _sft_cfg(tiny_lm_dir, sft_file)
        objective = sft.SFTObjective(cfg, tmp_path)
    else:
        cfg = _rm_cfg(tiny_reward_model_dir, pairs_file)
        objective = reward_model.RewardObjective(cfg, tmp_path)
    trainer = sft.SupervisedTrainer(cfg, tmp_path, objective)
    with torch.no_grad():
        _, stats = objective.loss(objective.train_items[:2])
    lengths = []

    def fake_all_reduce_grads(params, extra):
        lengths.append(extra.numel())
        return extra

    monkeypatch.setattr(distributed, "_active", True, raising=False)
    monkeypatch.setattr(trainer, "world", distributed.World(1, 2, 1))
    monkeypatch.setattr(distributed, "all_reduce_grads", fake_all_reduce_grads)
    loss, summed = trainer._all_reduced(torch.zeros(()), {})  # this rank: no items, no stats
    trainer._all_reduced(torch.zeros(()), stats)  # the next step: the stats are back
    assert lengths == [1 + len(stats)] * 2 and sorted(summed) == sorted(stats)
    assert sorted(stats) == sorted(objective.stat_keys)  # what the loss returns is what the objective declares
