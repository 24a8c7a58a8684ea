"""Every recipe of README.md and docs/recipes.md runs as written.

A recipe is a fenced block preceded by `<!-- recipe -->`: its lines (a trailing backslash continues one) are
`ppoforge ...` or `torchrun ... -m ppoforge ...` commands, run one after another without a shell in a fresh
folder. A block preceded by `<!-- recipe-file: NAME -->` is a file the later recipes of the same page use
(prompts, a reward function, an environment, a pipeline file); it is written into that folder verbatim.

Shortened only by appending options the CLI documents, so each runs in seconds on a tiny random model
(`lm/models/tiny.py`, saved as `tiny/`; a one-label sequence-classification copy as `tiny-rm/`):
`train rlhf` gets `--model tiny --total-updates 1` (and `--reward model:tiny-rm` where it names a reward
model), `train sft | reward` `--model tiny --max-steps 2`, `train control` `--total-steps 1024`, `plan`
`--model tiny`; a pipeline file gets the
same values in its stages (`model: tiny`, `max_steps: 2`, `total_updates: 1`), since `ppoforge pipeline`
takes no field options. `torchrun` recipes run as written: 2 processes on gloo.

Held-out prompts: a run over your own `--prompts` file holds out a share of that file (20 rows or more) or
says it holds none out (fewer); both are asserted on the run's completions.jsonl.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml

from ppoforge.runtime.fsdp import cpu_unsupported_reason

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/recipes.md"]
MARK = re.compile(r"^<!--\s*recipe(?:-file:\s*(?P<name>\S+))?\s*-->\s*$")
FENCE = re.compile(r"^(```+|~~~+)")
HELDOUT_MIN_ROWS = 20  # heldout_prompts auto: fewer prompts than this hold none out (lm/data/prompts.py)


@dataclass
class Recipe:
    page: str
    line: int  # 1-based line of the marker
    commands: list[list[str]]
    files: dict[str, str] = field(default_factory=dict)  # the page's recipe files defined above it

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def torchrun(self) -> bool:
        return any(c[0] == "torchrun" for c in self.commands)


def _blocks(text: str):
    """(marker line, file name or None, block text) for every marked fenced block; a marker that is not
    followed by a fenced block yields block text None."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i].strip())
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        fence = FENCE.match(lines[j].strip()) if j < len(lines) else None
        if fence is None:
            yield i + 1, m["name"], None
            i = j
            continue
        end = j + 1
        while end < len(lines) and not lines[end].strip().startswith(fence.group(1)):
            end += 1
        yield i + 1, m["name"], "\n".join(lines[j + 1:end]) + "\n"
        i = end + 1


def _commands(block: str) -> list[list[str]]:
    """The block's command lines, continuations joined, comments dropped, each split as a shell would."""
    joined = re.sub(r"\\\n", " ", block)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def recipes(page: str, root: Path = ROOT) -> list[Recipe | tuple[int, str]]:
    """The page's recipes, in order; a marker without a block or a block without a command is (line, why)."""
    out, files = [], {}
    for line, name, block in _blocks((root / page).read_text()):
        if block is None:
            out.append((line, "the marker is not followed by a fenced block"))
        elif name:
            files[name] = block
        elif not (commands := _commands(block)):
            out.append((line, "the recipe block has no command"))
        else:
            out.append(Recipe(page, line, commands, dict(files)))
    return out


ALL = [r for page in PAGES for r in recipes(page) if isinstance(r, Recipe)]


def test_every_marked_block_is_a_recipe_of_known_commands():
    for page in PAGES:
        found = recipes(page)
        bad = [f"{page}:{r[0]}: {r[1]}" for r in found if not isinstance(r, Recipe)]
        assert not bad, bad
        for r in found:
            for argv in r.commands:
                assert _ppoforge_args(argv) is not None, f"{r.id}: not a ppoforge or torchrun command: {argv}"
    readme = [r for r in ALL if r.page == "README.md"]
    # the front page's five recipes (one with two torchrun commands) and the doctor, all marked
    assert len(readme) >= 7, [r.id for r in readme]
    assert {"train", "pipeline", "doctor"} <= {_ppoforge_args(a)[0] for r in readme for a in r.commands}
    assert any(r.torchrun for r in readme)
    # the held-out split of the user's own prompts is shown (and asserted by _check_heldout) in some recipe
    assert any(_splits_heldout(r, argv) for r in ALL for argv in r.commands)


def _splits_heldout(recipe: Recipe, argv: list[str]) -> bool:
    args = _ppoforge_args(argv)
    prompts = _option(args, "--prompts")
    return (args[:2] == ["train", "rlhf"] and prompts in recipe.files and _option(args, "--run-dir") is not None
            and _option(args, "--heldout-prompts") is None
            and sum(1 for line in recipe.files[prompts].splitlines() if line.strip()) >= HELDOUT_MIN_ROWS)


def test_a_marker_without_a_command_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- recipe -->\n```bash\n# only a comment\n```\n\n<!-- recipe -->\ntext\n")
    assert recipes("page.md", tmp_path) == [(1, "the recipe block has no command"),
                                  (6, "the marker is not followed by a fenced block")]


def _ppoforge_args(argv: list[str]) -> list[str] | None:
    """The arguments after `ppoforge` (or after `torchrun ... -m ppoforge`), or None."""
    if argv[0] == "ppoforge":
        return argv[1:]
    if argv[0] == "torchrun" and "-m" in argv and argv[argv.index("-m") + 1] == "ppoforge":
        return argv[argv.index("-m") + 2:]
    return None


def _option(argv: list[str], name: str) -> str | None:
    """The last value given to `name` (the CLI's last one wins)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    return values[-1] if values else None


def _shortened(argv: list[str], folder: Path) -> list[str]:
    args = _ppoforge_args(argv)
    if args[:2] == ["train", "rlhf"]:
        extra = ["--model", "tiny", "--total-updates", "1"]
        if "model:" in (_option(args, "--reward") or ""):
            extra += ["--reward", "model:tiny-rm"]
        return argv + extra
    if args[:2] in (["train", "sft"], ["train", "reward"]):
        return argv + ["--model", "tiny", "--max-steps", "2"]
    if args[:2] == ["train", "control"]:
        return argv + ["--total-steps", "1024"]
    if args[:1] == ["plan"]:
        return argv + ["--model", "tiny"]
    if args[:1] == ["pipeline"]:
        path = folder / args[1]
        spec = yaml.safe_load(path.read_text())
        for stage, extra in (("sft", {"max_steps": 2}), ("reward", {"max_steps": 2}), ("ppo", {"total_updates": 1})):
            if stage not in spec:
                continue
            if stage != "ppo" or "model" in spec[stage]:  # PPO's model is the SFT stage's export by default
                extra = {"model": "tiny", **extra}
            spec[stage] |= extra
        path.write_text(yaml.safe_dump(spec))
    return argv


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """tiny/: the doctor's tiny Qwen2-shaped causal LM; tiny-rm/: a one-label reward model with its tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    from ppoforge.lm.models.tiny import save_tiny_lm

    root = tmp_path_factory.mktemp("tiny_models")
    save_tiny_lm(root / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(root / "tiny")
    config = AutoConfig.from_pretrained(root / "tiny")
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(root / "tiny-rm")
    tokenizer.save_pretrained(root / "tiny-rm")
    return root


def _environment() -> dict:
    bin_dir = str(Path(sys.executable).parent)  # this venv's ppoforge and torchrun first
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": str(Path(__import__("ppoforge").__file__).parents[1])}


def _check_heldout(argv: list[str], folder: Path, stderr: str) -> None:
    """A run over a recipe's own prompt file: its held-out prompts come from that file, none trained on."""
    args = _ppoforge_args(argv)
    prompts, run_dir = _option(args, "--prompts"), _option(args, "--run-dir")
    if args[:2] != ["train", "rlhf"] or not prompts or not (folder / prompts).is_file() or not run_dir:
        return
    if _option(args, "--heldout-prompts") is not None:
        return
    mine = {json.loads(line)["prompt"] for line in (folder / prompts).read_text().splitlines() if line.strip()}
    rows = [json.loads(line) for line in (folder / run_dir / "completions.jsonl").read_text().splitlines()]
    heldout = {r["prompt"] for r in rows if r["split"] == "heldout"}
    trained = {r["prompt"] for r in rows if r["split"] == "train"}
    if len(mine) < HELDOUT_MIN_ROWS:
        assert not heldout
        assert "too few to hold some out" in stderr
        return
    assert heldout, "no held-out rows in completions.jsonl"
    assert heldout <= mine, heldout - mine  # the user's prompts, not the demo's held-out set
    assert not heldout & trained
    assert f"of {len(mine)} prompts are held out of training" in stderr


def _expect_fsdp_refused(argv: list[str]) -> bool:
    return _option(_ppoforge_args(argv), "--fsdp") == "true" and cpu_unsupported_reason() is not None


def _run(recipe: Recipe, folder: Path, tiny_models: Path) -> None:
    for name in ("tiny", "tiny-rm"):
        (folder / name).symlink_to(tiny_models / name)
    for name, text in recipe.files.items():
        (folder / name).write_text(text)
    for argv in recipe.commands:
        cmd = _shortened(argv, folder)
        proc = subprocess.run(cmd, cwd=folder, env=_environment(), capture_output=True, text=True, timeout=900)
        if _expect_fsdp_refused(argv):  # torch 2.6: FSDP2 has no CPU stream events; one line (torchrun exits 1)
            assert proc.returncode == (1 if argv[0] == "torchrun" else 2), proc.stderr[-3000:]
            assert re.search(r"^ppoforge: error: (rank \d: )?fsdp: FSDP2 on CPU needs torch\.cpu\.Stream\.record_event",
                             proc.stderr, re.M), proc.stderr[-3000:]
            continue
        assert proc.returncode == 0, f"{recipe.id}: {shlex.join(cmd)}\n{proc.stderr[-3000:]}"
        _check_heldout(argv, folder, proc.stderr)


@pytest.mark.parametrize("recipe", [pytest.param(r, id=r.id, marks=[pytest.mark.torchrun] if r.torchrun else [])
                                    for r in ALL])
def test_recipe_runs_as_written(recipe, tmp_path, tiny_models):
    _run(recipe, tmp_path, tiny_models)
