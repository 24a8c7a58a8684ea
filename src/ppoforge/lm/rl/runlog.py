"""The RLHF trainer's run dir, the pieces `runtime/runloop.py` strings together: the logs opened (config,
data report, progress, the held-out evaluation before training), each update's metrics and completions,
the held-out evaluation every `heldout_every`, the export after the last update, summary.json and the
curves. A mixin of `RLHFTrainer` (lm/rl/trainer.py), which holds the state these read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ppoforge.lm.models.parts import EXPORT_DIR, export_dtype
from ppoforge.runtime import distributed
from ppoforge.runtime.metrics import MetricsLogger, first_and_last, open_run_dir, plot_curves, write_summary
from ppoforge.runtime.progress import Progress

TABLE_ROWS = 8  # completions shown in TensorBoard per logging step (all of them go to completions.jsonl)


@dataclass
class TrainResult:
    run_dir: Path
    updates: int
    episodes: int
    last_metrics: dict          # the metrics of the last update run in this call ({} if none)
    stopped_by: str | None      # a signal name when interrupted
    export: Path | None = None  # the exported model's folder (None: stopped before the end)
    heldout: tuple[float, float] | None = None  # the held-out mean score before the first and after the last update


class RunLog:
    """`RLHFTrainer`'s run-dir half (see the module docstring)."""

    def open_run(self) -> None:
        """Before this process's first update: the run dir's config and logs (`open_run_dir`), the data report,
        the progress bar; on a fresh run the held-out evaluation before training."""
        cfg, main = self.cfg, self.world.is_main  # rank 0 alone writes the run dir
        self.logger = open_run_dir(self.run_dir, cfg, distributed.describe(cfg.batch_size, "prompts"), self.update,
                                   ("metrics.jsonl", "completions.jsonl"), main)
        if main:  # how many prompts trained, were held out or cut (max_prompt_tokens)
            (self.run_dir / "data_report.json").write_text(json.dumps(self.inputs.data_report(), indent=1) + "\n")
        self.progress = Progress(cfg.total_updates, self.update, enabled=cfg.progress and main, unit="update")
        self.last: dict = {}  # the metrics of the last update run
        try:
            if self.update == 0:
                self._log_heldout(self.logger)
                if "rollback" in (cfg.nonfinite_action, cfg.collapse_action):
                    self.run_guard.save()  # a rollback needs a checkpoint to go back to
        except BaseException:
            self.close_run()
            raise

    def after_update(self, result: tuple[dict, list[dict]]) -> None:
        """`train_loop`'s after_update (inside its RunGuard): the update's metrics and completions every
        log_every updates, the held-out evaluation every heldout_every, the progress bar."""
        (metrics, table), cfg = result, self.cfg
        self.last.update(metrics)
        if self.update % cfg.log_every == 0 or self.update == cfg.total_updates:
            self.logger.log(self.update, metrics)
            self._log_table(self.logger, "train", table)
        if cfg.heldout_every and self.update % cfg.heldout_every == 0 and self.update < cfg.total_updates:
            self._log_heldout(self.logger)  # the last update's evaluation comes after the loop
        self.progress.advance(1, score=metrics["objective/scores"], kl=metrics.get("objective/kl"))

    def finish(self) -> Path:
        """After the last update: the held-out evaluation, then the tuned policy exported to RUN/model (`export`:
        the LoRA adapter, merged, or both; `export_dtype`). Returns the export's folder."""
        cfg, export = self.cfg, self.run_dir / EXPORT_DIR
        self._log_heldout(self.logger)
        if self.world.is_main or self.sharded:  # sharded, every rank takes part in gathering the weights
            self.layout.export(export, cfg.export, export_dtype(cfg.export_dtype, self.precision.name), self.tokenizer)
        return export

    def summarize(self, stopped: str | None, export: Path | None) -> TrainResult:
        """The run's result; rank 0 writes it to summary.json (`write_summary`, docs/metrics.md) with the
        held-out score before and after training read back from metrics.jsonl (a resumed run's too)."""
        result = TrainResult(self.run_dir, self.update, self.update * self.cfg.rollout_size, self.last, stopped, export)
        if self.world.is_main:
            result.heldout = first_and_last(self.run_dir / "metrics.jsonl", "eval/scores")
            before, after = result.heldout or (None, None)
            write_summary(self.run_dir, "rlhf", self.update, "update", stopped, export, self.last,
                          episodes=result.episodes, heldout_before=before, heldout_after=after)
        return result

    def close_run(self) -> None:
        self.progress.close()
        self.logger.close()
        self.engine.close()

    def plot(self) -> None:
        """reward_kl.png from metrics.jsonl (rank 0)."""
        cfg = self.cfg
        if self.world.is_main:
            plot_curves(self.run_dir / "metrics.jsonl", ["objective/scores", "objective/kl", "objective/rlhf_reward",
                        "eval/scores"], self.run_dir / "reward_kl.png", title=f"{cfg.curve_title}: {cfg.model}")

    def _log_heldout(self, logger: MetricsLogger) -> None:
        result = self.heldout()
        if result is not None:
            scores = torch.tensor([r["score"] for r in result[1]], dtype=torch.float64)  # cpu: host floats
            half = 1.96 * float(scores.std()) / len(scores) ** 0.5 if len(scores) > 1 else 0.0  # the mean's 95 %
            logger.log(self.update, {"eval/scores": result[0], "eval/scores_lo": result[0] - half,
                                     "eval/scores_hi": result[0] + half})
            self._log_table(logger, "heldout", result[1])

    def _log_table(self, logger: MetricsLogger, split: str, table: list[dict]) -> None:
        if not self.world.is_main:
            return
        with (self.run_dir / "completions.jsonl").open("a") as f:
            for row in table:
                f.write(json.dumps({"step": self.update, "split": split, **row}) + "\n")
        lines = ["| prompt | completion | score |", "|---|---|---|"]
        lines += [f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['score']:.3f} |"
                  for r in table[:TABLE_ROWS]]
        logger.log_text(self.update, f"completions/{split}", "\n".join(lines))


def _cell(text: str | list) -> str:
    """A completions-table cell; a conversational prompt (a list of messages) as `role: content` turns."""
    if not isinstance(text, str):
        text = " ".join(f"{m['role']}: {m['content']}" for m in text)
    return text.replace("|", "\\|").replace("\n", " ")[:200]
