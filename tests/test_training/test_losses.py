import math

import pytest
import torch

from training.losses import kl_to_target, listwise_ce


def test_listwise_ce_matches_equation_2_by_hand():
    scores = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    expected = (-math.log(math.exp(2) / (math.exp(2) + math.exp(1) + 1)) - math.log(1 / 3)) / 2
    assert listwise_ce(scores).item() == pytest.approx(expected, rel=1e-6)
    # an explicit positive index (in-batch negatives) picks another column
    assert listwise_ce(scores[:1], torch.tensor([1])).item() == pytest.approx(
        -math.log(math.exp(1) / (math.exp(2) + math.exp(1) + 1)), rel=1e-6
    )


def test_kl_matches_the_definition_with_temperature():
    target = torch.tensor([[3.0, 0.0, 0.0]])
    student = torch.tensor([[0.0, 3.0, 0.0]])
    tau = 3.0
    t = torch.softmax(target / tau, -1)
    s = torch.softmax(student / tau, -1)
    expected = float((t * (t / s).log()).sum())
    assert kl_to_target(target, student, tau).item() == pytest.approx(expected, rel=1e-6)
    assert kl_to_target(student, student, tau).item() == pytest.approx(0.0, abs=1e-7)


def test_no_gradient_reaches_the_model_that_produced_the_kl_target():
    target = torch.randn(2, 4, requires_grad=True)
    student = torch.randn(2, 4, requires_grad=True)
    loss = listwise_ce(student) + kl_to_target(target, student, tau=3.0)
    loss.backward()
    assert target.grad is None
    assert student.grad is not None and student.grad.abs().sum() > 0
