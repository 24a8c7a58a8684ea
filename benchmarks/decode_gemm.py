"""What one decode step's matmuls cost at a model's shapes: F.linear against weights prepacked for oneDNN.

A decode step multiplies a few rows (the completions being sampled) by every weight of the model, so it
streams all of them from memory once per token. This times the matmuls of one step alone, at a
workload's shapes (`rlhf_workloads.py`; q, k, v and gate, up stacked as ppoforge's lean decoder stacks
them, plus the LM head), for each row count:

- `F.linear`: what Hugging Face's forward (TRL's decode) runs: MKL's fp32 GEMM on CPU;
- `prepacked`: ppoforge's lean decoder on CPU, weights reordered once for oneDNN by the decoder's own
  `prepared.pack` and multiplied by its `prepared.packed_linear` (`lm/models/prepared.py`);

next to the machine's read bandwidth (a sum over 512 MiB), which bounds any decode of these weights.

    python benchmarks/decode_gemm.py --workload smollm2 --rows 1,8,32 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rlhf_workloads  # noqa: E402
from flops import mean_seconds  # noqa: E402
from ppoforge.lm.models import prepared  # noqa: E402


def step_shapes(w: rlhf_workloads.Workload) -> list[tuple[int, int]]:
    """(in, out) of each matmul in one decode step: per layer q+k+v, o, gate+up, down; then the LM head."""
    head_dim = w.hidden // w.heads
    qkv = (w.heads + 2 * w.kv_heads) * head_dim
    layer = [(w.hidden, qkv), (w.hidden, w.hidden), (w.hidden, 2 * w.intermediate), (w.intermediate, w.hidden)]
    return layer * w.layers + [(w.hidden, w.vocab)]


def one_step(linear, shapes, weights, xs) -> None:
    for (n_in, _), weight in zip(shapes, weights, strict=True):
        linear(xs[n_in], weight, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="smollm2", choices=sorted(rlhf_workloads.WORKLOADS))
    p.add_argument("--rows", default="1,8,32", help="comma-separated rows per step (completions decoded at once)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = step_shapes(rlhf_workloads.WORKLOADS[args.workload])
    weights = [torch.randn(n_out, n_in) * 0.02 for n_in, n_out in shapes]
    gib = sum(t.numel() for t in weights) * 4 / 2**30
    big = torch.randn(2**27)  # 512 MiB
    bandwidth = big.numel() * 4 / mean_seconds(big.sum) / 1e9
    print(f"{args.workload}: {len(shapes)} matmuls per step, {gib:.2f} GiB of fp32 weights; "
          f"read bandwidth {bandwidth:.1f} GB/s, {args.threads} threads, torch {torch.__version__}\n")
    print("| rows | F.linear ms/step | prepacked ms/step | prepacked speed-up | prepacked GB/s of weights |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {n_in: torch.randn(rows, n_in) for n_in, _ in shapes}
        packed = [prepared.pack((w, None))[0] for w in weights]
        plain = mean_seconds(functools.partial(one_step, F.linear, shapes, weights, xs))
        prepacked = mean_seconds(functools.partial(one_step, prepared.packed_linear, shapes, packed, xs))
        print(f"| {rows} | {plain * 1e3:.1f} | {prepacked * 1e3:.1f} | {plain / prepacked:.2f}× | "
              f"{gib * 2**30 / prepacked / 1e9:.1f} |")


if __name__ == "__main__":
    main()
