"""The Bradley-Terry reward-model loss (InstructGPT; TRL's RewardTrainer) and its diagnostics.

    loss = mean(-log sigmoid(r_chosen - r_rejected - margin)) + center_coef * mean((r_chosen + r_rejected)^2)

The optional per-pair `margin` (Llama 2's) asks for a larger gap where raters were more certain; the
centering term (Eisenstein et al. 2023, TRL's `center_rewards_coefficient`) keeps the rewards near 0,
which the BT loss alone leaves free (it only sees differences).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       center_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, detached stats: accuracy = share of pairs ranked right, gap = mean r_chosen - r_rejected)."""
    gap = r_chosen - r_rejected
    loss = -F.logsigmoid(gap - (margin if margin is not None else 0.0)).mean()
    if center_coef:
        loss = loss + center_coef * ((r_chosen + r_rejected) ** 2).mean()
    with torch.no_grad():
        stats = {"accuracy": (gap > 0).float().mean(), "gap": gap.mean()}
    return loss, stats
