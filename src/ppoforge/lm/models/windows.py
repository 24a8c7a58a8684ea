"""Which positions a model's layers attend to: every earlier one, or a window (sliding-window and chunked layers).

Windowed layers: Mistral, Mixtral, Phi-3 and Starcoder2 slide on every layer (`sliding_window`); Gemma 2 and
3, Cohere 2, gpt-oss and Qwen2 with `use_sliding_window` mix sliding and full layers (`layer_types`, derived
from Gemma's `sliding_window_pattern` and Qwen2's `max_window_layers`); Llama 4 attends within chunks on some
layers (`chunked_attention`, `attention_chunk_size`). A sliding layer lets a query see the keys less than
`sliding_window` positions back (transformers' `kv_idx > q_idx - sliding_window`), a chunked one the keys of
its own chunk.

ppoforge hands every layer the same 4D mask (attention.py, rows.py, the SFT packing, reward branch rows):
exact for a full-attention layer, and for a windowed one exactly while every sequence of a row fits in its
window — a window at least as long as the sequence is full attention, the same model. Past it a windowed layer
would attend where the model never does: silently another model. So a run whose sequences can outgrow the
window is refused in one line (`check_window`), and a path that has an exact alternative for long rows
(transformers' own per-layer masks: unpacked SFT, right-padded reward rows) takes it instead.
"""

from __future__ import annotations

from ppoforge.errors import UserError

# layer type -> (the config attribute that holds its window, how a refusal names it)
WINDOWED = {"sliding_attention": ("sliding_window", "a sliding window"),
            "chunked_attention": ("attention_chunk_size", "chunks")}


def layer_windows(config) -> list[tuple[str, int] | None]:
    """Per decoder layer: (layer type, its window in positions) for a windowed layer, None for one that attends
    to every earlier position. `config` is a model's config (a multimodal one: its text model's)."""
    config = config.get_text_config()
    types = getattr(config, "layer_types", None)
    if types is None:  # one kind of layer (Mistral, Mixtral, Phi-3): sliding wherever sliding_window is set
        # Qwen2-MoE keeps its sliding_window with use_sliding_window off (0 or the old value)
        slides = getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None)
        types = ["sliding_attention" if slides else "full_attention"] * (getattr(config, "num_hidden_layers", 1) or 1)
    out = []
    for kind in types:
        attr = WINDOWED.get(kind, (None, None))[0]
        size = getattr(config, attr, None) if attr else None
        out.append((kind, int(size)) if size else None)
    return out


def attention_window(config) -> int | None:
    """The smallest window any layer of the model attends within, in positions; None when every layer attends
    to all earlier positions. A sequence of at most this many tokens sees the model exactly as full attention."""
    sizes = [w[1] for w in layer_windows(config) if w is not None]
    return min(sizes) if sizes else None


def describe_windows(config) -> str:
    """E.g. 'gemma3_text attends within a sliding window of 512 positions on 22 of 26 layers'."""
    layers = layer_windows(config)
    windowed = [w for w in layers if w is not None]
    kind, size = min(windowed, key=lambda w: w[1])
    share = "every layer" if len(windowed) == len(layers) else f"{len(windowed)} of {len(layers)} layers"
    return (f"{config.get_text_config().model_type} attends within {WINDOWED[kind][1]} of {size} positions "
            f"on {share}")


def check_window(config, tokens: int, rows: str, allowed: str, field: str = "model") -> None:
    """Refuse, in one line naming the model, its window and what is allowed, sequences of up to `tokens`
    positions (`rows` says where that number comes from) on a model with a window shorter than that. `allowed`
    is what the caller can change (`{window}` in it: the window); the line adds 'or a model whose layers all
    attend to every position'."""
    window = attention_window(config)
    if window is None or tokens <= window:
        return
    raise UserError(f"{field}: {describe_windows(config)}, and this run's rows reach {tokens} positions ({rows}); "
                    f"allowed: {allowed.format(window=window)}, or a model whose layers all attend to every "
                    "position — windowed layers past their window are not supported yet")
