"""LM PPO and GRPO under torchrun (gloo, 2 CPU processes): the same parameters as one process with the
same global batch, rank-0-only run-dir writes, resume on another world size, and one rank's failure as
one line on all. Tolerance: fp32, 1e-6 absolute (the only difference is float summation order: each
rank's forward runs half the rows, and the gradients are summed over ranks). Then FSDP2 (`fsdp: true`,
the full layout of RLHF, SFT and reward training): 2 sharded ranks against one plain process (1e-5),
resume 2 <-> 1, the gathered export; skipped where torch cannot run FSDP2 on CPU (2.6)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ppoforge
from ppoforge.cli import main
from ppoforge.runtime.launch import free_port, torchrun
from ppoforge.runtime.metrics import read_metrics

PROMPTS = ["tell a story about the rain", "write one sentence about coffee", "describe the city at night",
           "a review of a good movie", "tell me about your friend", "the weather today is",
           "write about the sun", "describe my morning"]
SRC = str(Path(ppoforge.__file__).parents[1])
ATOL = 1e-6
FSDP_SKIP = None
if not hasattr(torch.cpu.Stream, "record_event"):  # runtime/fsdp.py's cpu_unsupported_reason, without importing it
    FSDP_SKIP = (f"FSDP2 on CPU needs torch.cpu.Stream.record_event, which torch {torch.__version__} lacks (its "
                 "first all-gather fails); the world-1 fsdp path runs on it")
needs_fsdp = pytest.mark.skipif(FSDP_SKIP is not None, reason=str(FSDP_SKIP))
FSDP = dict(layout="full", fsdp="true", learning_rate=1e-3)
SUPERVISED_FSDP = ["--layout", "full", "--fsdp", "true", "--learning-rate", "1e-3"]


def _args(model, prompts, run_dir, **overrides):
    values = dict(model=model, prompts=prompts, heldout_prompts="none", max_prompt_tokens=16, max_new_tokens=6,
                  batch_size=4, mini_batch_size=2, micro_batch_size=1, ppo_epochs=2, total_updates=1,
                  learning_rate=1e-2, device="cpu", seed=0, torch_threads=1, progress="false",
                  tensorboard="false", reward="length:4", max_grad_norm=1e6, dist_timeout=60, precision="fp32",
                  stop_tokens=",".join(map(str, range(10, 60))))  # ragged responses
    values.update(overrides)
    out = ["train", "rlhf", "--run-dir", str(run_dir)] if run_dir else ["train", "rlhf"]
    for k, v in values.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def launch(args, nproc=2, timeout=240, extra_path=(), **kwargs):
    """torchrun --standalone in its own session: on a timeout the launcher and its workers are killed
    together (no orphaned rank keeps loading the machine) and the test fails with their output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, *map(str, extra_path)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen(torchrun(args, nproc, **kwargs), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun still running after {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _trainable(run_dir):
    return torch.load(Path(run_dir) / "checkpoint.pt", weights_only=True)["trainable"]


def _assert_same_params(a, b, atol=ATOL):
    assert a.keys() == b.keys() and len(a) > 0
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max |2 ranks - 1 rank| = {worst:.3g}")  # the values seen: docs/distributed.md
    assert worst <= atol, f"max |2 ranks - 1 rank| = {worst:.3g}"


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


# ---- one torchrun launch for every 2-rank run that must simply succeed --------------------------------
# A launch pays torch + transformers' import on both ranks and a rendezvous before a run of a few seconds.
# The tests that take `launched` get their 2-rank runs from ONE launch of the module (tests/conftest.py:
# torchrun_runs) and compare them with the one-process runs they make themselves. Tests whose launch ends
# (a failing rank, SIGTERM, exit 2) or that need another topology (two nodes) launch on their own.

def _launched_runs(test: str, lm: Path, rm: Path, prompts: Path, d: Path) -> tuple[list, list]:
    """(the one-process runs to make before the launch, the 2-rank runs) of `test` (its name with its
    parameters), with their run dirs in `d`."""
    name, _, param = test.rstrip("]").partition("[")
    if name == "test_two_ranks_equal_one_rank":
        return [], [_args(lm, prompts, d / "two", **VARIANTS[param])]
    if name == "test_episode_heldout_with_fewer_pairs_than_ranks_does_not_pair_collectives_wrongly":
        heldout = d / "heldout.jsonl"
        heldout.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
        return [], [_args(lm, prompts, d / "r", **EPISODES, heldout_prompts=heldout, heldout_samples=1,
                          dist_timeout=20)]
    if name in ("test_resume_two_to_one_and_one_to_two", "test_fsdp_resume_two_to_one_and_one_to_two"):
        common = {**RESUME, **(FSDP if "fsdp" in name else {})}
        return ([_args(lm, prompts, d / "b", total_updates=2, **common)],
                [_args(lm, prompts, d / "a", total_updates=2, **common),
                 ["train", "rlhf", "--resume", str(d / "b"), "--total-updates", "3"]])
    if name == "test_sft_and_reward_two_ranks_equal_one_rank":
        return [], [_supervised_args(param, lm if param == "sft" else rm, d, d / "two")]
    if name == "test_fsdp_two_ranks_equal_one_plain_rank":
        return [], [_args(lm, prompts, d / "two", **FSDP, **FSDP_VARIANTS[param])]
    if name == "test_fsdp_bf16_reference_computes_what_the_policy_computes":
        return [], [_args(lm, prompts, d / "r", precision="bf16", **FSDP)]
    assert name == "test_fsdp_sft_and_reward_two_ranks_equal_one_plain_rank", name
    return [], [[*_supervised_args(param, lm if param == "sft" else rm, d, d / "two"), *SUPERVISED_FSDP]]


@pytest.fixture(scope="module")
def two_ranks(request, tiny_lm_dir, tiny_reward_model_dir, prompts_file, tmp_path_factory, torchrun_runs) -> dict:
    """{test name: its folder of runs}: every selected test of this module that takes `launched`, its
    2-rank runs in one launch (the FSDP ones left out where this torch cannot run FSDP2: they skip)."""
    root = tmp_path_factory.mktemp("two_ranks")
    tests = [item.name for item in request.session.items if item.module is request.module
             and "launched" in item.fixturenames and not (FSDP_SKIP and "fsdp" in item.name)]
    folders, launched = {}, []
    for i, test in enumerate(tests):
        folders[test] = root / str(i)
        folders[test].mkdir()
        before, runs = _launched_runs(test, tiny_lm_dir, tiny_reward_model_dir, prompts_file, folders[test])
        for argv in before:
            assert main(argv) == 0
        launched += runs
    if launched:
        torchrun_runs(launched, root / "launch")
    return folders


@pytest.fixture
def launched(two_ranks, request) -> Path:
    """This test's folder of 2-rank runs, made by the module's one launch (`two_ranks`)."""
    return two_ranks[request.node.name]


VARIANTS = {
    "ppo-lora": dict(layout="lora"),
    "ppo-full": dict(layout="full", learning_rate=1e-3),
    # micro-batches of a whole group: its forwards run shared-prefix rows (lm/models/rows.py)
    "grpo": dict(layout="lora", advantage="grpo", num_generations=2, batch_size=2, kl_in="loss", kl_estimator="k3",
                 ppo_epochs=1, mini_batch_size=4, micro_batch_size=2, loss_agg="seq_mean_token_mean"),
    "grpo-episodes": dict(layout="lora", advantage="grpo", num_generations=2, batch_size=2, kl_coef=0, ppo_epochs=1,
                          mini_batch_size=4, micro_batch_size=1, env="guess_number?hi=4", reward="env", max_turns=2,
                          max_env_tokens=24),
}


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_equal_one_rank(tiny_lm_dir, prompts_file, tmp_path, variant, launched):
    one, two = tmp_path / "one", launched / "two"
    assert main(_args(tiny_lm_dir, prompts_file, one, **VARIANTS[variant])) == 0
    _assert_same_params(_trainable(one), _trainable(two))
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert len(m1) == len(m2) == 1 and m2[0]["perf/world_size"] == 2 and m2[0]["perf/rank_rollout"] == 2
    assert m2[0]["perf/shared_prefix_unit"] == (2 if variant == "grpo" else 1)
    for key, value in _strip(m1)[0].items():  # global metrics: all-reduced, equal to the single-process ones
        assert m2[0][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert (two / "config.yaml").read_text().startswith("# world_size: 2, per-rank batch: ")
    rows = [json.loads(line) for line in (two / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4  # every rank's completions, written once by rank 0


EPISODES = dict(layout="lora", advantage="grpo", num_generations=2, batch_size=2, kl_coef=0, ppo_epochs=1,
                mini_batch_size=4, micro_batch_size=1, env="guess_number?hi=4", reward="env", max_turns=2,
                max_env_tokens=24)


@pytest.mark.slow
@pytest.mark.torchrun
def test_episode_heldout_with_fewer_pairs_than_ranks_does_not_pair_collectives_wrongly(launched):
    """One held-out prompt, one sample: rank 1 holds no pair of the held-out batch. It must still join the
    collectives the other rank runs while playing (the environment's error flag, `checked`), else every
    later collective pairs with the wrong one (a hang, a DistTimeout, or gloo's size mismatch)."""
    rows = [json.loads(line) for line in (launched / "r" / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "heldout"] == [0, 1]  # before and after training


@pytest.mark.torchrun
def test_batch_that_does_not_divide_by_the_ranks_is_one_line_exit_2(tiny_lm_dir, prompts_file, tmp_path):
    run = launch(_args(tiny_lm_dir, prompts_file, tmp_path / "r", batch_size=3, mini_batch_size=3))
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.startswith("ppoforge: error:")]
    assert len(lines) == 1 and "batch_size: 3 does not divide by the 2 ranks" in lines[0], run.stderr[-3000:]
    assert 2 in _worker_exit_codes(run.stderr)  # every rank knows it: rank 0 alone prints it; exit 2


RESUME = dict(anneal_lr="false", ppo_epochs=1)  # annealing follows total_updates, which the resumes raise


@pytest.mark.slow
@pytest.mark.torchrun
def test_resume_two_to_one_and_one_to_two(tiny_lm_dir, prompts_file, tmp_path, launched):
    """Checkpoints written by 2 ranks continue on 1 and the other way round, and both equal a run that
    never stopped: the shared generator and the global data cursor are in rank 0's checkpoint. The launch
    ran `a` for 2 updates and resumed `b` (2 updates in one process: `_launched_runs`) to 3."""
    straight = tmp_path / "straight"
    assert main(_args(tiny_lm_dir, prompts_file, straight, total_updates=3, **RESUME)) == 0
    a, b = launched / "a", launched / "b"
    assert main(["train", "rlhf", "--resume", str(a), "--total-updates", "3"]) == 0
    for resumed in (a, b):
        rows = read_metrics(resumed / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert torch.load(resumed / "checkpoint.pt", weights_only=True)["cursor"] == 3 * 4
        _assert_same_params(_trainable(straight), _trainable(resumed))


RAISING = textwrap.dedent("""
    import os, time

    def raise_on_rank1(prompts, completions, **kwargs):
        if os.environ.get("RANK") == "1":
            raise ValueError("boom on purpose")
        return [1.0] * len(completions)

    def hang_on_rank1(prompts, completions, **kwargs):
        if os.environ.get("RANK") == "1":
            time.sleep(600)
        return [1.0] * len(completions)
""")


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.parametrize("how", ["raises", "hangs", "raises-fsdp"])
def test_one_rank_failing_stops_all_with_one_line(tiny_lm_dir, prompts_file, tmp_path, how):
    """With fsdp the checkpoint is collective: every rank knows of the error, so every rank writes its
    shards of the state at the failing update's start."""
    if how == "raises-fsdp" and FSDP_SKIP:
        pytest.skip(FSDP_SKIP)
    (tmp_path / "ddp_rewards.py").write_text(RAISING)
    fn = "hang_on_rank1" if how == "hangs" else "raise_on_rank1"
    args = _args(tiny_lm_dir, prompts_file, tmp_path / "r", reward=f"py:ddp_rewards:{fn}", total_updates=2,
                 dist_timeout=8, call_timeout=600, **(FSDP if how == "raises-fsdp" else {}))
    run = launch(args, timeout=120, extra_path=[tmp_path])
    lines = [line for line in run.stderr.splitlines() if line.startswith("ppoforge: error:")]
    assert run.returncode != 0
    if how == "raises-fsdp":
        assert len(lines) == 1 and "rank 1: reward py:ddp_rewards:raise_on_rank1 raised ValueError" in lines[0]
        assert "checkpoint at update 0" in lines[0], lines
        assert len(list((tmp_path / "r" / "checkpoint").glob("*.distcp"))) == 2
        assert torch.load(tmp_path / "r" / "checkpoint" / "extra.pt", weights_only=True)["update"] == 0
    elif how == "raises":
        assert len(lines) == 1, run.stderr[-3000:]  # rank 0's; rank 1 leaves the line to it
        assert lines[0].startswith("ppoforge: error: rank 1: reward py:ddp_rewards:raise_on_rank1 raised ValueError: "
                                   "boom on purpose; checkpoint at update 0: continue with "), lines
        # bad input on rank 1: every worker exits 2 (its code), which the launcher's summary reports for each
        # failed worker; the launcher itself exits 1 after its ChildFailedError traceback (torchrun's, not ours)
        assert sorted(_worker_exit_codes(run.stderr)) == [2, 2] and run.returncode == 1, run.stderr[-3000:]
    else:
        assert lines and lines[0].startswith("ppoforge: error: rank 0: a collective did not complete within 8 s "
                                             "(dist_timeout)"), run.stderr[-3000:]


def _worker_exit_codes(launcher_stderr: str) -> list[int]:
    """The workers' exit codes in torchrun's failure summary (`exitcode  : 2 (pid: ...)`, one per failed rank)."""
    import re

    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+) \(pid", launcher_stderr)]


@pytest.mark.slow
@pytest.mark.torchrun
def test_two_nodes_on_one_machine_match_one_node(tiny_lm_dir, prompts_file, tmp_path):
    """Two `torchrun --nnodes 2 --node-rank {0,1}` launches of one process each, over a c10d rendezvous
    on 127.0.0.1, train together and match the single-process run."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(_args(tiny_lm_dir, prompts_file, one)) == 0
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    nodes = [subprocess.Popen(torchrun(_args(tiny_lm_dir, prompts_file, two), 1, 0, nnodes=2, node_rank=r,
                                       rdzv_endpoint=endpoint), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in nodes]
    assert all(p.returncode == 0 for p in nodes), outs[0][1][-2000:] + outs[1][1][-2000:]
    _assert_same_params(_trainable(one), _trainable(two))


def test_world_one_writes_no_torchrun_note(tiny_lm_dir, prompts_file, tmp_path):
    assert main(_args(tiny_lm_dir, prompts_file, tmp_path / "r", total_updates=1, ppo_epochs=1)) == 0
    assert (tmp_path / "r" / "config.yaml").read_text().startswith("# world_size: 1")
    assert sys.modules["ppoforge.runtime.distributed"].world().size == 1


TOPICS = ["the movie", "the coffee", "the weather", "the city", "my morning", "the book"]
GOOD, BAD = ["great", "wonderful", "happy", "love"], ["terrible", "awful", "sad", "hate"]


def _supervised_args(kind, model, tmp_path, run_dir):
    data = tmp_path / f"{kind}.jsonl"
    if kind == "sft":
        rows = [{"prompt": f"tell me about {t}", "completion": f"{t} is {w} and {t} is {w}"}
                for t in TOPICS for w in GOOD[:2]]
    else:
        rows = [{"prompt": f"tell me about {t}", "chosen": f"it is {g}", "rejected": f"it is {b}"}
                for t in TOPICS for g, b in zip(GOOD[:2], BAD[:2], strict=True)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["train", kind, "--run-dir", str(run_dir), "--model", str(model), "--data", str(data), "--lora-r", "4",
            "--max-length", "64", "--batch-size", "4", "--micro-batch-size", "1", "--epochs", "1",
            "--eval-fraction", "0.25", "--eval-every", "100", "--learning-rate", "1e-2", "--device", "cpu",
            "--torch-threads", "1", "--progress", "false", "--tensorboard", "false", "--dist-timeout", "60",
            "--precision", "fp32",  # auto is bf16 on some CI CPUs: these compare ranks to 1e-5
            *(["--sample-prompts", "0"] if kind == "sft" else [])]


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_sft_and_reward_two_ranks_equal_one_rank(kind, tiny_lm_dir, tiny_reward_model_dir, tmp_path, launched):
    """12 rows: 9 train (batches of 4, 4, 1: the last leaves rank 1 nothing), 3 held out."""
    model = tiny_lm_dir if kind == "sft" else tiny_reward_model_dir
    one, two = tmp_path / "one", launched / "two"
    assert main(_supervised_args(kind, model, tmp_path, one)) == 0
    # 3 AdamW steps at lr 1e-2: Adam's first steps are ~lr * sign(g), so a float-order difference in a
    # near-zero gradient component moves its weight by up to ~1e-6 a step (seen: 1.7e-6 for reward)
    _assert_same_params(_trainable(one), _trainable(two), atol=1e-5)
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["step"] for r in m1] == [r["step"] for r in m2] == [0, 1, 2, 3]
    for a, b in zip(m1, m2, strict=True):
        for key, value in _strip([a])[0].items():
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert (two / "model" / "adapter_config.json").is_file()  # LoRA: the adapter (`export: adapter`), rank 0's


EXIT_RECORDER = textwrap.dedent("""
    # `python -m ppoforge`, but each worker's exit code is written to exit.<RANK> in $EXIT_DIR: torchrun
    # reports none of them after a SIGTERM, and distributed.finish leaves through os._exit
    import os
    import sys

    from ppoforge.cli import main

    _exit = os._exit

    def record(code):
        with open(os.path.join(os.environ["EXIT_DIR"], "exit." + os.environ["RANK"]), "w") as f:
            f.write(str(code))
        _exit(code)

    os._exit = record
    record(main(sys.argv[1:]))
""")


@pytest.mark.slow
@pytest.mark.torchrun
def test_sigterm_to_the_launcher_checkpoints_once(tiny_lm_dir, prompts_file, tmp_path):
    """torchrun forwards SIGTERM to its workers; they agree to stop after the update under way, rank 0
    writes one checkpoint, each exits 0 (rank 0 alone says so), and the run resumes from it. The launcher
    then raises its own SignalException (a traceback) and exits 1: torchrun's, documented."""
    import time

    run_dir = tmp_path / "r"
    (tmp_path / "exit_recorder.py").write_text(EXIT_RECORDER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(tmp_path)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "EXIT_DIR": str(tmp_path)}
    launcher = subprocess.Popen(torchrun(_args(tiny_lm_dir, prompts_file, run_dir, total_updates=500,
                                               ppo_epochs=1, checkpoint_every=1000), 2, module="exit_recorder"),
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.5)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    assert out.count("stopped by SIGTERM, checkpoint saved") == 1, out + err[-3000:]
    assert [(tmp_path / f"exit.{r}").read_text() for r in (0, 1)] == ["0", "0"]  # every worker: exit 0
    assert "SignalException" in err and launcher.returncode == 1  # the launcher's own ending
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert saved["update"] == read_metrics(metrics)[-1]["step"] >= 2
    assert not list(run_dir.glob(".checkpoint.pt.*.tmp"))  # no write left half done


# ---- FSDP2 (`fsdp: true`, the full layout): 2 sharded ranks against 1 plain process -----------------------

def _sharded_weights(run_dir, tmp_path) -> dict:
    """The trained weights of a run dir's sharded checkpoint, gathered into one dict (any world size)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{Path(run_dir).name}.pt"
    dcp_to_torch_save(Path(run_dir) / "checkpoint", out)
    return torch.load(out, weights_only=True)["model"]


FSDP_VARIANTS = {
    "ppo-full": dict(),  # PPO with its critic: 2 epochs x 2 mini-batches, ragged prompts and responses across ranks
    "grpo-full": dict(advantage="grpo", num_generations=2, batch_size=2, kl_in="loss", kl_estimator="k3", ppo_epochs=1,
                      mini_batch_size=4, micro_batch_size=2, loss_agg="seq_mean_token_mean"),  # shared-prefix rows
}


@pytest.mark.slow
@pytest.mark.torchrun
@needs_fsdp
@pytest.mark.parametrize("variant", list(FSDP_VARIANTS))
def test_fsdp_two_ranks_equal_one_plain_rank(tiny_lm_dir, prompts_file, tmp_path, variant, launched):
    overrides = FSDP_VARIANTS[variant]
    one, two = tmp_path / "one", launched / "two"
    assert main(_args(tiny_lm_dir, prompts_file, one, **FSDP, **overrides)) == 0  # world 1: not sharded
    assert len(list((two / "checkpoint").glob("*.distcp"))) == 2  # each rank wrote its shards
    a, b = _sharded_weights(one, tmp_path), _sharded_weights(two, tmp_path)
    initial = load_file(Path(tiny_lm_dir) / "model.safetensors")
    assert max(float((a[f"policy.lm.{k}"] - v).abs().max()) for k, v in initial.items()) > 1e-4  # it trained
    assert any(k.startswith("critic.") for k in a) == ("advantage" not in overrides)
    _assert_same_params(a, b, atol=1e-5)
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert m2[0]["perf/shared_prefix_unit"] == (2 if variant == "grpo-full" else 1)
    for key, value in _strip(m1)[0].items():
        assert m2[0][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    # the export gathers the shards: rank 0 writes the whole policy
    p1, p2 = load_file(one / "model" / "model.safetensors"), load_file(two / "model" / "model.safetensors")
    _assert_same_params(p1, p2, atol=1e-5)
    assert p2.keys() == p1.keys() and all(p2[k].shape == p1[k].shape for k in p1)


@pytest.mark.slow
@pytest.mark.torchrun
@needs_fsdp
def test_fsdp_resume_two_to_one_and_one_to_two(tiny_lm_dir, prompts_file, tmp_path, launched):
    """A sharded checkpoint of 2 ranks continues in one process and the other way round; both equal a
    run that never stopped. The launch ran `a` for 2 updates and resumed `b` (2 updates in one process) to 3."""
    straight, a, b = tmp_path / "straight", launched / "a", launched / "b"
    assert main(_args(tiny_lm_dir, prompts_file, straight, total_updates=3, **RESUME, **FSDP)) == 0
    assert main(["train", "rlhf", "--resume", str(a), "--total-updates", "3"]) == 0
    want = _sharded_weights(straight, tmp_path)
    for resumed in (a, b):
        assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl")] == [1, 2, 3]
        _assert_same_params(want, _sharded_weights(resumed, tmp_path), atol=1e-5)


def test_fsdp_at_world_one_trains_and_resumes_the_plain_full_layout(tiny_lm_dir, prompts_file, tmp_path):
    """Without torchrun `fsdp` shards nothing: the same numbers as the plain full layout, in a sharded-format
    checkpoint that a resume (on any world size) reads. Runs on every torch, 2.6 included."""
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    common = dict(layout="full", learning_rate=1e-3, anneal_lr="false", ppo_epochs=1)
    assert main(_args(tiny_lm_dir, prompts_file, plain, total_updates=2, **common)) == 0
    assert main(_args(tiny_lm_dir, prompts_file, sharded, total_updates=1, fsdp="true", **common)) == 0
    assert (sharded / "checkpoint" / ".metadata").is_file() and not (sharded / "checkpoint.pt").exists()
    assert main(["train", "rlhf", "--resume", str(sharded), "--total-updates", "2"]) == 0
    want, got = _trainable(plain), _sharded_weights(sharded, tmp_path)
    _assert_same_params({_sharded_name(k): v for k, v in want.items()}, got, atol=0)


def _sharded_name(name: str) -> str:
    """checkpoint.pt's name of a trained weight -> the sharded checkpoint's (lm/models/parts.py: Trunk, CriticTrunk)."""
    head, rest = name.split(".", 1)
    return {"policy": "policy.lm.", "critic": "critic.backbone.", "value_head": "critic.value_head."}[head] + rest


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(layout="lora", fsdp="true"), "fsdp: shards the full layout's models; layout lora trains adapters"),
    (dict(layout="full", fsdp="true", rollout_engine="hf"), "rollout_engine: hf with fsdp would run a collective per"),
])
def test_fsdp_config_errors_are_one_line(tiny_lm_dir, prompts_file, tmp_path, capsys, overrides, message):
    assert main(_args(tiny_lm_dir, prompts_file, tmp_path / "r", **overrides)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.torchrun
@needs_fsdp
def test_fsdp_bf16_reference_computes_what_the_policy_computes(launched):
    """Under FSDP's bf16 policy the reference is stored in bf16: the KL before the first update is 0."""
    first = read_metrics(launched / "r" / "metrics.jsonl")[0]
    assert first["objective/kl"] == 0.0


@pytest.mark.slow
@pytest.mark.torchrun
@needs_fsdp
@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_fsdp_sft_and_reward_two_ranks_equal_one_plain_rank(kind, tiny_lm_dir, tiny_reward_model_dir, tmp_path,
                                                            launched):
    """SFT and reward training, full layout, FSDP2 on 2 ranks: the last batch (1 item) leaves rank 1 a
    zero-weight micro-batch, so both ranks run the same forwards; the same weights and metrics as one
    process, a sharded checkpoint and a gathered export."""
    model = tiny_lm_dir if kind == "sft" else tiny_reward_model_dir
    one, two = tmp_path / "one", launched / "two"
    assert main([*_supervised_args(kind, model, tmp_path, one), *SUPERVISED_FSDP]) == 0
    assert len(list((two / "checkpoint").glob("*.distcp"))) == 2
    _assert_same_params(_sharded_weights(one, tmp_path), _sharded_weights(two, tmp_path), atol=1e-5)
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["step"] for r in m1] == [r["step"] for r in m2] == [0, 1, 2, 3]
    for a, b in zip(m1, m2, strict=True):
        for key, value in _strip([a])[0].items():
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    _assert_same_params(load_file(one / "model" / "model.safetensors"), load_file(two / "model" / "model.safetensors"),
                        atol=1e-5)


@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_supervised_fsdp_needs_the_full_layout(kind, tiny_lm_dir, tiny_reward_model_dir, tmp_path, capsys):
    model = tiny_lm_dir if kind == "sft" else tiny_reward_model_dir
    assert main([*_supervised_args(kind, model, tmp_path, tmp_path / "r"), "--fsdp", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fsdp: shards a fully trained model; layout lora trains adapters" in err[0], err


def test_supervised_fsdp_at_world_one_writes_a_sharded_checkpoint(tiny_lm_dir, tmp_path):
    """Without torchrun `fsdp` shards nothing; the checkpoint is in the format any world size resumes."""
    run_dir = tmp_path / "r"
    assert main([*_supervised_args("sft", tiny_lm_dir, tmp_path, run_dir), "--layout", "full", "--fsdp", "true",
                 "--epochs", "0.5"]) == 0
    assert (run_dir / "checkpoint" / ".metadata").is_file() and not (run_dir / "checkpoint.pt").exists()
    assert main(["train", "sft", "--resume", str(run_dir), "--epochs", "1"]) == 0
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")][-1] == 3


def _forced_runs(kind, tiny_lm_dir, prompts_file, tmp_path):
    """(the command line of a run in `run_dir`, the collectives it must go through) per kind of run."""
    rlhf = {"all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list"}
    if kind == "ppo":
        return lambda run_dir: _args(tiny_lm_dir, prompts_file, run_dir), rlhf
    if kind == "grpo-episodes-heldout":
        heldout = tmp_path / "heldout.jsonl"
        heldout.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
        return (lambda run_dir: _args(tiny_lm_dir, prompts_file, run_dir, **EPISODES, heldout_prompts=heldout,
                                      heldout_samples=1), rlhf)
    return (lambda run_dir: _supervised_args("sft", tiny_lm_dir, tmp_path, run_dir),
            {"all_reduce", "broadcast", "broadcast_object_list"})


@pytest.mark.parametrize("kind", ["ppo", "grpo-episodes-heldout", "sft-heldout"])
def test_forced_collectives_at_world_one_give_the_same_metrics(kind, tiny_lm_dir, prompts_file, tmp_path,
                                                               monkeypatch):
    """PPOFORGE_FORCE_COLLECTIVES=1 without torchrun: a one-process gloo group, every all-reduce / gather
    taken instead of the world-1 shortcut (counted), and the metrics of the plain world-1 run (the path one
    GPU then runs is the one eight run)."""
    from ppoforge.runtime import distributed

    command, expected = _forced_runs(kind, tiny_lm_dir, prompts_file, tmp_path)
    plain, forced = tmp_path / "plain", tmp_path / "forced"
    assert main(command(plain)) == 0
    ops = []
    real = distributed._collective
    monkeypatch.setattr(distributed, "_collective", lambda op, *a: (ops.append(op.__name__), real(op, *a))[1])
    monkeypatch.setenv(distributed.FORCE_ENV, "1")
    assert main(command(forced)) == 0
    assert not distributed.collectives() and not torch.distributed.is_initialized()  # finish() left the group
    assert expected <= set(ops), sorted(set(ops))
    m1, m2 = read_metrics(plain / "metrics.jsonl"), read_metrics(forced / "metrics.jsonl")
    assert [r["step"] for r in m1] == [r["step"] for r in m2]
    assert any("eval/" in k for r in m1 for k in r) == (kind != "ppo")
    for a, b in zip(_strip(m1), _strip(m2), strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=0, abs=1e-6), key
