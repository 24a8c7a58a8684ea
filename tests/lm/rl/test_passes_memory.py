"""Measured: the scoring passes' peak memory is the micro-batch's, not the rollout's. The peak is counted
below autograd (a TorchDispatchMode adds each op output's fresh storage while a tensor holds it), so it is
torch's own allocations, free of the allocator's caching and of other processes."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ppoforge.config import build_config
from ppoforge.lm.models.sampler import Samples
from ppoforge.lm.rl.config import RLHFConfig
from ppoforge.lm.rl.trainer import RLHFTrainer


class PeakBytes(TorchDispatchMode):
    """The most bytes of op outputs alive at once (each storage once, freed when its last output tensor dies)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list] = {}  # storage data_ptr -> [bytes, tensors alive]
        self.now = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.live:
                    self.live[ptr] = [t.untyped_storage().nbytes(), 0]
                    self.now += self.live[ptr][0]
                    self.peak = max(self.peak, self.now)
                self.live[ptr][1] += 1
                weakref.finalize(t, self._release, ptr)
        return out


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, tiny_lm_dir):
    """Qwen2-shaped, hidden 256, 4 layers (the tiny tokenizer): a rollout pass's activations are ~100 MiB."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    config = Qwen2Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, vocab_size=len(tok), max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("wide")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def peak_mib(trainer: RLHFTrainer, rows: int, chunk: int) -> float:
    """Peak bytes (MiB) of the scoring passes (old log-probs and values, reference) over `rows` rows of 256
    positions, `chunk` rows at a time."""
    vocab = trainer.layout.policy_model.config.vocab_size
    ids = torch.randint(3, vocab, (rows, 256), generator=torch.Generator().manual_seed(0))
    samples = Samples(ids[:, 128:], torch.ones(rows, 128), torch.zeros(rows, 128), torch.ones(rows, dtype=torch.bool))
    trainer.passes.chunk_rows = chunk
    with torch.inference_mode(), PeakBytes() as mode:
        trainer.passes(ids, torch.ones(rows, 256), samples)
    return mode.peak / 2**20


def test_the_scoring_peak_stays_flat_when_the_rollout_grows_four_times(wide_model, tmp_path):
    cfg = build_config(RLHFConfig, dict(
        model=str(wide_model), prompts="demo", heldout_prompts="none", max_prompt_tokens=128, max_new_tokens=128,
        batch_size=8, mini_batch_size=8, micro_batch_size=8, ppo_epochs=1, device="cpu", torch_threads=1,
        progress=False, tensorboard=False, kl_coef=0.05, old_logprobs="recompute", attn_implementation="eager",
        shared_prefix="off", precision="fp32"))
    trainer = RLHFTrainer(cfg, tmp_path, reward_fn=lambda p, c, **k: [0.0] * len(c))
    small, large, whole = peak_mib(trainer, 16, 8), peak_mib(trainer, 64, 8), peak_mib(trainer, 64, 64)
    print(f"scoring peak: 16 rows {small:.1f} MiB, 64 rows {large:.1f} MiB in chunks of 8, {whole:.1f} MiB in one pass")
    assert large < 1.1 * small  # flat: the micro-batch's peak (plus the rollout's (B, T) outputs)
    assert whole > 3 * small    # the control: one pass over the rollout grows with it


def test_the_lean_reference_pass_holds_one_layers_keys_and_values_whatever_the_depth():
    """The LoRA layout's reference pass through the lean decoder (`base_hidden`) runs all positions in one
    pass, so a layer's K/V is dead once the layer is done: 8 layers peak where 2 do, not 6 layers' K/V
    (16 rows x 256 positions x 2 kv heads x 64 x fp32 x K and V = 4 MiB a layer) higher. Same hidden states."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ppoforge.lm.models.decoders import LlamaDecoder
    from ppoforge.lm.models.rows import padded

    def peak_and_hidden(layers: int) -> tuple[float, torch.Tensor]:
        torch.manual_seed(0)
        config = Qwen2Config(hidden_size=256, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=512, vocab_size=512, max_position_embeddings=512)
        model = Qwen2ForCausalLM(config).eval()
        decoder = LlamaDecoder(model)
        ids = torch.randint(3, 512, (16, 256), generator=torch.Generator().manual_seed(0))
        rows = padded(ids, torch.ones(16, 256), 128)
        with torch.inference_mode():
            decoder.base_hidden(rows)  # the weights prepared once, outside the count
            with PeakBytes() as mode:
                hidden = decoder.base_hidden(rows)
            want = model(ids, output_hidden_states=True).hidden_states[-1][:, -129:-1]
        assert (hidden - want).abs().max() < 1e-4
        return mode.peak / 2**20, hidden

    (two, _), (eight, _) = peak_and_hidden(2), peak_and_hidden(8)
    print(f"lean reference pass peak: 2 layers {two:.1f} MiB, 8 layers {eight:.1f} MiB")
    assert eight < two + 1.0, (two, eight)
