import math

import torch

from alignflow.stages.common.logprobs import token_logprobs
from alignflow.stages.sft.losses import sft_loss


def test_token_logprobs_by_hand():
    # Vocabulary of 2; uniform logits at t=0, logits (0, ln 3) at t=1.
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 0]])
    got = token_logprobs(logits, ids)
    # p(ids[1]=1 | t=0) = 1/2 ; p(ids[2]=0 | t=1) = 1/(1+3)
    torch.testing.assert_close(got, torch.tensor([[math.log(0.5), math.log(0.25)]]))


def test_sft_loss_by_hand():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]])  # predicts positions 1.. -> mask[:, 1:]
    loss, parts = sft_loss(logps, mask, num_tokens=3.0)
    # Trained: row0 t=1 (-2), t=2 (-3); row1 t=0 (-4). NLL sum = 9, over 3 tokens.
    assert parts["tokens"].item() == 3 and parts["nll_sum"].item() == 9.0
    assert loss.item() == 3.0


def test_mask_selecting_nothing_gives_zero_loss_and_zero_grad():
    logps = torch.randn(2, 5, requires_grad=True)
    loss, parts = sft_loss(logps, torch.zeros(2, 6), num_tokens=1.0)
    loss.backward()
    assert loss.item() == 0.0 and parts["tokens"].item() == 0 and torch.all(logps.grad == 0)


def test_micro_batches_sum_to_the_full_batch_gradient():
    """Normalising each micro-batch by the step's token count makes accumulation exact."""
    torch.manual_seed(0)
    weight = torch.randn(7, 11, requires_grad=True)
    hidden = torch.randn(8, 6, 7)
    ids = torch.randint(0, 11, (8, 6))
    mask = (torch.rand(8, 6) > 0.4).float()
    total = float(mask[:, 1:].sum())

    def loss_of(rows):
        logits = hidden[rows] @ weight
        return sft_loss(token_logprobs(logits, ids[rows]), mask[rows], total)[0]

    full = torch.autograd.grad(loss_of(slice(0, 8)), weight)[0]
    parts = sum(torch.autograd.grad(loss_of(slice(k, k + 2)), weight)[0] for k in range(0, 8, 2))
    torch.testing.assert_close(parts, full)
    # Two "workers" with 4 rows each, gradients summed (the seam undoes DeepSpeed's averaging).
    workers = torch.autograd.grad(loss_of(slice(0, 4)), weight)[0] + torch.autograd.grad(loss_of(slice(4, 8)), weight)[0]
    torch.testing.assert_close(workers, full)
