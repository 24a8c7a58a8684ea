"""Bradley-Terry loss against hand-computed values."""

import math

import torch

from ppoforge.core.preference import bradley_terry_loss


def test_bt_loss_by_hand():
    # gaps 1 and -2: -log sigmoid(1) = log(1 + e^-1) = 0.313262; -log sigmoid(-2) = log(1 + e^2) = 2.126928
    loss, stats = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 2.0]))
    assert math.isclose(loss.item(), (0.313262 + 2.126928) / 2, rel_tol=1e-5)
    assert stats["accuracy"] == 0.5 and stats["gap"] == -0.5


def test_margin_asks_for_a_larger_gap():
    # gap 1, margin 1: -log sigmoid(0) = log 2
    loss, _ = bradley_terry_loss(torch.tensor([2.0]), torch.tensor([1.0]), margin=torch.tensor([1.0]))
    assert math.isclose(loss.item(), math.log(2), rel_tol=1e-6)


def test_centering_adds_the_mean_squared_sum():
    # r = (3, 1): BT -log sigmoid(2) = 0.126928; centering 0.01 * (3 + 1)^2 = 0.16
    loss, _ = bradley_terry_loss(torch.tensor([3.0]), torch.tensor([1.0]), center_coef=0.01)
    assert math.isclose(loss.item(), 0.126928 + 0.16, rel_tol=1e-5)


def test_gradient_pushes_the_pair_apart():
    rc, rr = torch.tensor([0.5], requires_grad=True), torch.tensor([0.5], requires_grad=True)
    bradley_terry_loss(rc, rr)[0].backward()
    assert rc.grad.item() == -0.5 and rr.grad.item() == 0.5  # d/d gap of -log sigmoid(gap) at 0 = -1/2
