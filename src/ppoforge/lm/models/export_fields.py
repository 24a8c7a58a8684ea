"""The export fields every LM trainer config declares (RLHF, SFT, reward), written once. A module of its own: the
configs import it at CLI start-up, before torch's model libraries (parts.py, which exports, loads peft)."""

from __future__ import annotations

from ppoforge.config import param

EXPORT_KINDS = ("adapter", "merged", "both")


def export_param():
    """`export`: what RUN/model holds at the end."""
    return param("adapter", "what RUN/model holds at the end: adapter (LoRA: the adapter alone in PEFT format, as "
                 "TRL saves), merged (base + adapter as one model), both (the merged model in RUN/model/merged); "
                 "the full layout saves the whole model", choices=EXPORT_KINDS, resume=True)


def export_dtype_param():
    """`export_dtype`: the dtype of a merged or full export."""
    return param("auto", "dtype of a merged or full export: auto (the training precision: bf16 in a bf16 run, else "
                 "fp32), fp32, bf16", choices=("auto", "fp32", "bf16"), resume=True)
