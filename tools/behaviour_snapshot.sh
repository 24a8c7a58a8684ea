#!/usr/bin/env bash
# The metrics of five small runs, for "a refactor changes no number": record them before, record them
# after, and compare (`tools/metrics_digest.py BEFORE AFTER`). Timing fields are left out of the
# comparison; every other logged value must be bit-identical on the same machine and torch.
#   tools/behaviour_snapshot.sh OUT_DIR     (uses .venv's ppoforge; ~10 min on a 2-core CPU)
set -euo pipefail
out=${1:?usage: tools/behaviour_snapshot.sh OUT_DIR}
pf=${PPOFORGE:-.venv/bin/ppoforge}
mkdir -p "$out"
common=(--overwrite --progress false --tensorboard false)
# PPO with a critic, the SmolLM2 built-in model, the BENCHMARKS.md tiny workload, 3 updates
$pf train rlhf --preset tiny --total-updates 3 --run-dir "$out/rlhf_ppo" "${common[@]}"
# GRPO (group advantages, KL in the loss), vader reward
$pf train rlhf --preset grpo --total-updates 2 --max-new-tokens 16 --run-dir "$out/rlhf_grpo" "${common[@]}"
# multi-turn: 2-turn guess_number episodes
$pf train rlhf --preset guess_number --max-turns 2 --total-updates 2 --batch-size 2 --mini-batch-size 16 \
  --run-dir "$out/rlhf_guess" "${common[@]}"
# SFT and reward model, tiny presets, the built-in demo data
$pf train sft --preset tiny --data demo-sft --epochs 0.2 --eval-every 2 --run-dir "$out/sft" "${common[@]}"
$pf train reward --preset tiny --data demo-pairs --epochs 0.2 --eval-every 2 --run-dir "$out/reward" "${common[@]}"
"${PYTHON:-.venv/bin/python}" "$(dirname "$0")/metrics_digest.py" "$out"
