"""The LM PPO benchmark workloads of shared/BENCHMARKS.md, built identically for TRL and ppoforge.

Both benchmark workers import this file, and they run in different venvs (TRL's pins its own
transformers), so it needs only torch + transformers + tokenizers. `build(name, out_dir)` writes:

    out_dir/policy/      random-init Qwen2ForCausalLM (policy and reference start here)
    out_dir/reward/      random-init Qwen2ForSequenceClassification, num_labels=1 (reward; TRL's value too)
    out_dir/tokenizer/   the tokenizer, in its own folder (see below)
    out_dir/prompts.jsonl  {"prompt": "t17 t903 ...", "input_ids": [17, 903, ...]}, all the same length
    out_dir/workload.json  the Workload fields

The tokenizer is word-level with exactly `vocab` entries (<pad>=0, </s>=1, <unk>=2, then "t3".."t{V-1}"),
so a prompt's text round-trips to the same ids and any sampled id decodes. Prompts avoid ids 0-2.
It lives apart from the models because transformers 5's AutoTokenizer, seeing a config.json with
model_type "qwen2" next to it, forces Qwen2Tokenizer (a byte-level BPE) over tokenizer.json and silently
maps every word to <unk>; with no config.json beside it, the saved word-level tokenizer loads as is.
Weights are saved once and loaded by every run, so both frameworks start from identical models.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    n_prompts: int  # prompts per PPO update (the rollout batch)
    prompt_len: int
    new_tokens: int
    micro_batch: int  # training micro-batch; 1 mini-batch = all prompts, so accumulation = n / micro
    # GRPO workloads of real text (reasoning_workload.py): the reasoning-gym task (None: random-id prompts and
    # the random-init reward model), the KL coefficient, whether EOS stops a completion
    task: str | None = None
    beta: float = 0.04
    eos: bool = True


WORKLOADS = {
    "tiny": Workload("tiny", 64, 2, 4, 2, 256, 1024, False, 16, 32, 32, 8),
    "small": Workload("small", 256, 4, 4, 2, 1024, 8192, False, 16, 32, 64, 8),
    "smollm2": Workload("smollm2", 576, 30, 9, 3, 1536, 49152, True, 8, 24, 32, 4),
    # the arithmetic preset's shape (`--grpo --grpo-new-tokens 10`): an 80-token prompt, short answers
    "arith": Workload("arith", 576, 30, 9, 3, 1536, 49152, True, 4, 80, 10, 8),
    # Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 / 2 heads, intermediate 4864, vocab 151936, tied): a GPU
    # workload (benchmarks/gpu_check.sh); ~0.5 B parameters, far too slow for a 2-core CPU
    "qwen05b": Workload("qwen05b", 896, 24, 14, 2, 4864, 151936, True, 16, 24, 32, 8),
    # the real SmolLM2-135M-Instruct (ppoforge's cached checkpoint), reasoning-gym chain_sum problems behind a
    # 121-token few-shot header, beta 0 (reasoning_workload.py; built with ppoforge's venv); prompt_len = the
    # longest prompt, set at build time; n_prompts = the prompt file's rows (a run uses its first --prompts)
    "reasoning": Workload("reasoning", 576, 30, 9, 3, 1536, 49152, True, 16, 0, 128, 8, task="chain_sum", beta=0.0),
}


def qwen2_config(w: Workload, **extra):
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=w.hidden, num_hidden_layers=w.layers, num_attention_heads=w.heads,
        num_key_value_heads=w.kv_heads, intermediate_size=w.intermediate, vocab_size=w.vocab,
        tie_word_embeddings=w.tied, max_position_embeddings=2048, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
        bos_token_id=None, **extra,
    )


def word_level_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
    words.update({f"t{i}": i for i in range(3, vocab)})
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>",
                                  unk_token="<unk>", padding_side="left")
    assert len(tok) == vocab, (len(tok), vocab)
    return tok


def random_prompts(w: Workload, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, w.vocab, (w.n_prompts, w.prompt_len), generator=gen).tolist()


def build(name: str, out_dir: str | Path, seed: int = 0, eos: bool = True) -> Path:
    """Write the workload's models, tokenizer and prompts under out_dir; returns out_dir."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    w, out = WORKLOADS[name], Path(out_dir)
    if w.task:  # real model and text: built from ppoforge's cache (run this with ppoforge's venv)
        import reasoning_workload

        reasoning_workload.build(w, out, seed=seed + 1, eos=eos)
        return out
    tok = word_level_tokenizer(w.vocab)
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_config(qwen2_config(w))
    policy.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    policy.save_pretrained(out / "policy")
    tok.save_pretrained(out / "tokenizer")
    del policy
    torch.manual_seed(seed + 1)
    reward = AutoModelForSequenceClassification.from_config(qwen2_config(w, num_labels=1))
    reward.save_pretrained(out / "reward")
    del reward
    with open(out / "prompts.jsonl", "w") as f:
        for ids in random_prompts(w, seed):
            f.write(json.dumps({"prompt": tok.decode(ids), "input_ids": ids}) + "\n")
    (out / "workload.json").write_text(json.dumps(dataclasses.asdict(w), indent=1))
    return out


def write_supervised_data(w: Workload, out_dir: str | Path, rows: int, seed: int = 0) -> None:
    """sft.jsonl (prompt, completion) and pairs.jsonl (prompt, chosen, rejected) of random words for the
    SFT / reward-model benchmark: prompts of 16-32 words, completions of 16-96, so batches need padding."""
    gen = torch.Generator().manual_seed(seed + 7)
    words = lambda lo, hi: " ".join(f"t{int(i)}" for i in torch.randint(
        3, w.vocab, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),), generator=gen))
    out = Path(out_dir)
    with open(out / "sft.jsonl", "w") as sft, open(out / "pairs.jsonl", "w") as pairs:
        for _ in range(rows):
            prompt = words(16, 32)
            sft.write(json.dumps({"prompt": prompt, "completion": " " + words(16, 96)}) + "\n")
            pairs.write(json.dumps({"prompt": prompt, "chosen": " " + words(16, 96),
                                    "rejected": " " + words(16, 96)}) + "\n")


def supervised_worker_args(description: str) -> argparse.ArgumentParser:
    """The command line both SFT / reward-model benchmark workers take (TRL's and ppoforge's)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workload-dir", required=True, help="directory written by supervised_vs_trl.py")
    p.add_argument("--task", choices=["sft", "reward"], required=True)
    p.add_argument("--layout", choices=["full", "lora"], default="full")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--batch", type=int, default=16, help="examples (pairs) per optimizer step")
    p.add_argument("--micro", type=int, default=8, help="examples per forward/backward")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--precision", default="fp32", help="fp32 or bf16 (TRL: its bf16 flag, autocast; ppoforge: also "
                   "auto, bf16 where the CPU computes it natively)")
    p.add_argument("--padding-free", action="store_true", help="TRL SFT: padding_free=True (one packed row per "
                   "micro-batch, position ids restart per example)")
    p.add_argument("--shared-prefix", default="auto", help="ppoforge's reward model: auto (a pair as one row, the "
                   "prompt once) or off (chosen and rejected as two padded rows)")
    return p


def load_prompts(workload_dir: str | Path) -> list[list[int]]:
    with open(Path(workload_dir) / "prompts.jsonl") as f:
        return [json.loads(line)["input_ids"] for line in f]


def load_workload(workload_dir: str | Path) -> Workload:
    return Workload(**json.loads((Path(workload_dir) / "workload.json").read_text()))


def one_visible_gpu(device: str) -> None:
    """TRL's workers: a CUDA `device` ("cuda" or "cuda:N") leaves only that GPU visible (HF's Trainer would
    spread over every visible GPU with DataParallel; ppoforge's worker uses the one); "cpu" hides them all, so
    TRL's Accelerator cannot pick a GPU either. Call before anything touches CUDA."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2] or "0"


def peak_cuda_gib() -> float | None:
    """Peak CUDA memory torch allocated in this process, in GiB (None when CUDA was never initialized)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_initialized() else None


def peak_rss_gib() -> float:
    """Peak resident set of this process (VmHWM), in GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("VmHWM not found in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser(description="Build one LM PPO benchmark workload into a directory.")
    p.add_argument("name", choices=sorted(WORKLOADS), help="workload name (shapes from BENCHMARKS.md)")
    p.add_argument("out_dir", help="directory to write policy/, reward/, prompts.jsonl into")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and prompts")
    p.add_argument("--no-eos", action="store_true", help="reasoning: EOS does not stop completions (the sweep's "
                   "fixed lengths; reasoning_workload.py)")
    args = p.parse_args()
    print(build(args.name, args.out_dir, args.seed, eos=not args.no_eos))


if __name__ == "__main__":
    main()
