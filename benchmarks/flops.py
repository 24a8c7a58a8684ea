"""FLOPs per GRPO step, estimated the same way for both frameworks, and the machine's measured GEMM rate.

Estimate (`grpo_step_flops`), with N = the model's matmul parameters (`matmul_params`: every linear layer
plus the LM head, i.e. all parameters less an untied input embedding, which is a lookup) and T = the tokens
a pass runs over:

    FLOPs = N x T x (2 generation + 2 training forward + B backward + 2 reference forward if beta > 0)

- generation: a prefill of the prompt and one decode step per completion token, 2N per token;
- training forward: the policy's log-probs over prompt + completion, 2N per token (no old-log-prob pass: one
  optimizer step per rollout takes them from that forward on both sides, TRL's GRPO and ppoforge's);
- backward: B = 4 (2 x the forward: activation gradients and weight gradients, 2N each) for full
  fine-tuning (TRL's GRPOTrainer here, ppoforge's `full` layout); B = 2 for LoRA (ppoforge's `lora`): the
  frozen base needs no weight-gradient GEMMs, only the activation gradients (~1 x the forward); the
  adapters' own work (rank 16: ~4 % of N) is left out, as are attention's score and value products
  (4 x layers x hidden x context per token: ~5-20 % more at these lengths) and the softmax / norms;
- reference forward: only with a KL term (beta > 0; the `reasoning` workload has beta 0).

T three ways, padding never counted: `dense` = every completion with its own prompt, G x (prompt +
completion) per prompt — what a framework without prefix sharing runs (TRL's, ppoforge's shared_prefix off);
`shared` = each prompt once per group, prompt + the sum of its G completions — the least any framework must
run; `executed` = what this side runs: `dense` for TRL and shared_prefix off; for ppoforge's shared_prefix
auto one prefill per prompt, and in the training passes the prompt once per row of k completions (k = the
update's shared-prefix unit, perf/shared_prefix_unit; k = 1: padded rows, one prompt copy per completion).
The tables' "useful GFLOP/s" is `dense` / s per step (the same numerator on both sides, so its ratio is the
speed ratio, and it can pass the GEMM rate where sharing skips work); "of GEMM rate" is `executed` / s per
step against the GEMM rate of the run's compute dtype: how busy the side keeps the machine.

`python benchmarks/flops.py --threads 2 --seconds 2` measures the GEMM rate: a 2048 x 2048 torch.matmul in
fp32 and in bf16, each repeated for ~`seconds`, best of 3 such spans, with `threads` torch threads; prints one
BENCH_RESULT line {"fp32_gflops": ..., "bf16_gflops": ...}. rlhf_vs_trl.py runs it in a subprocess of its own
interpreter with the workers' thread count, in the same invocation as the runs it rates.
"""

from __future__ import annotations

import argparse
import json
import time


def matmul_params(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                  **_ignored) -> int:
    """Weights that multiply activations in one forward of a Llama / Qwen2 decoder (biases and norms left
    out): per layer q, o (h x h), k, v (h x kv_heads x head_dim), gate, up, down (h x intermediate); the LM
    head (vocab x h), tied or not."""
    kv = kv_heads * (hidden // heads)
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate) + vocab * hidden


def grpo_step_flops(params: int, prompt_tokens: list[int], completion_tokens: float, generations: int,
                    backward: float, reference: bool, gen_prompt_copies: float | None = None,
                    train_prompt_copies: float | None = None) -> dict:
    """{'dense', 'shared', 'executed'} FLOPs of one GRPO step (module docstring): `prompt_tokens` one length
    per prompt of the step, `completion_tokens` the step's completion tokens summed over all its completions.
    `executed` counts each prompt as often as the side runs it: `gen_prompt_copies` prefills per prompt (G
    for TRL and shared_prefix off, 1 for ppoforge's shared prefill) and `train_prompt_copies` per pass (G /
    the shared-prefix unit size k: a row of k completions holds the prompt once); default G: `dense`."""
    g = generations
    gen_copies = g if gen_prompt_copies is None else gen_prompt_copies
    train_copies = g if train_prompt_copies is None else train_prompt_copies
    train = 2 + backward + (2 if reference else 0)
    prompts = sum(prompt_tokens)
    count = lambda gen_p, train_p: params * (2 * (gen_p * prompts + completion_tokens)
                                             + train * (train_p * prompts + completion_tokens))
    return {"dense": count(g, g), "shared": count(1, 1), "executed": count(gen_copies, train_copies),
            "passes_per_token": 2 + train}


def mean_seconds(fn, repeats: int = 5) -> float:
    """Wall seconds per call of fn(), the mean of `repeats` calls after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def gemm_gflops(dtype, size: int, seconds: float) -> tuple[float, int]:
    import torch

    # a dtype the CPU only emulates (bf16 without AVX-512-BF16 or AMX: ~1 GFLOP/s) at a size whose product
    # takes under ~1 s: a 2048 product takes ~12 s there, and the rate is that slow at every size
    probe = torch.randn(256, 256, dtype=dtype)
    start = time.perf_counter()
    probe @ probe
    while size > 256 and (time.perf_counter() - start) * (size / 256) ** 3 > 1.0:
        size //= 2
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(3):
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 3 or n < 2:
            a @ b
            n += 1
        best = max(best, 2 * size**3 * n / elapsed / 1e9)
    return best, size


def main() -> None:
    p = argparse.ArgumentParser(description="Measure this machine's fp32 and bf16 GEMM rate (GFLOP/s).")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--size", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=2.0, help="per dtype")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    (fp32, size), (bf16, bf16_size) = (gemm_gflops(dtype, args.size, args.seconds)
                                       for dtype in (torch.float32, torch.bfloat16))
    result = {"size": size, "bf16_size": bf16_size, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "fp32_gflops": fp32, "bf16_gflops": bf16}
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
