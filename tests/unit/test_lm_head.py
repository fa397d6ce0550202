from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from alignflow.stages.common.lm_head import gather_rows, head_logprobs


def naive(hidden, weight, bias, targets, temperature=1.0):
    """Reference: full logits -> / T -> log_softmax -> gather; entropy from log_softmax."""
    logits = F.linear(hidden.to(torch.promote_types(hidden.dtype, torch.float32)), weight, bias) / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(1, targets[:, None]).squeeze(1)
    ent = -(logsm.exp() * logsm).sum(-1)
    return logp, ent


def make(n, h, v, dtype=torch.float64, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, dtype=dtype) / math.sqrt(h)).requires_grad_()
    b = (torch.randn(v, generator=gen, dtype=dtype) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=gen)
    coef = torch.randn(2, n, generator=gen, dtype=dtype)  # random loss coefficients for logp and entropy
    return hidden, weight, b, targets, coef


def grads(loss, tensors):
    tensors = [t for t in tensors if t is not None]
    return torch.autograd.grad(loss, tensors)


# hidden = [[1, 0], [0, 2]], W = [[1, 0], [0, 1], [1, 1]], b = [0, 0, -1], targets = [0, 2]
# z row 0 = [1, 0, 0], z row 1 = [0, 2, 1].
# T = 1: logp0 = 1 - log(e + 2) = -0.5514;  H0 = log(e + 2) - e / (e + 2) = 0.9753
#        logp1 = 1 - log(1 + e^2 + e) = -1.4076;  H1 = log(1 + e + e^2) - (2 e^2 + e) / (1 + e + e^2) = 0.8324
# T = 2: y0 = [.5, 0, 0]: logp0 = .5 - log(e^.5 + 2) = -0.7944;  H0 = log(e^.5 + 2) - .5 e^.5 / (e^.5 + 2) = 1.0684
#        y1 = [0, 1, .5]: logp1 = .5 - log(1 + e + e^.5) = -1.1803;  H1 = log(1 + e + e^.5) - (e + .5 e^.5) / (1 + e + e^.5) = 1.0202
# (H = -sum p log p = lse - sum p y, with p = softmax(y).)
HAND = {
    1.0: ([1 - math.log(math.e + 2), 1 - math.log(1 + math.e + math.e**2)],
          [math.log(math.e + 2) - math.e / (math.e + 2),
           math.log(1 + math.e + math.e**2) - (2 * math.e**2 + math.e) / (1 + math.e + math.e**2)]),
    2.0: ([0.5 - math.log(math.e**0.5 + 2), 0.5 - math.log(1 + math.e + math.e**0.5)],
          [math.log(math.e**0.5 + 2) - 0.5 * math.e**0.5 / (math.e**0.5 + 2),
           math.log(1 + math.e + math.e**0.5) - (math.e + 0.5 * math.e**0.5) / (1 + math.e + math.e**0.5)]),
}
HAND_ROUNDED = {1.0: ([-0.5514, -1.4076], [0.9753, 0.8324]), 2.0: ([-0.7944, -1.1803], [1.0684, 1.0202])}


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hand_computed(temperature, dtype):
    hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=dtype)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=dtype)
    bias = torch.tensor([0.0, 0.0, -1.0], dtype=dtype)
    logp, ent = head_logprobs(hidden, weight, bias, torch.tensor([0, 2]), temperature=temperature, chunk_rows=1, with_entropy=True)
    want_logp, want_ent = HAND[temperature]
    torch.testing.assert_close(logp, torch.tensor(want_logp, dtype=dtype))
    torch.testing.assert_close(ent, torch.tensor(want_ent, dtype=dtype))
    # The comment's rounded numbers agree with the formulas.
    torch.testing.assert_close(logp.double(), torch.tensor(HAND_ROUNDED[temperature][0], dtype=torch.float64), atol=1e-4, rtol=0)
    torch.testing.assert_close(ent.double(), torch.tensor(HAND_ROUNDED[temperature][1], dtype=torch.float64), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk", ["1", "3", "N", "N+5"])
def test_matches_naive(dtype, bias, chunk):
    n, temperature = 7, 0.7
    hidden, weight, b, targets, coef = make(n, 5, 11, dtype=dtype, bias=bias)
    chunk_rows = {"1": 1, "3": 3, "N": n, "N+5": n + 5}[chunk]
    logp, ent = head_logprobs(hidden, weight, b, targets, temperature=temperature, chunk_rows=chunk_rows, with_entropy=True)
    ref_logp, ref_ent = naive(hidden, weight, b, targets, temperature)
    assert logp.dtype == ref_logp.dtype and ent.dtype == ref_ent.dtype
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    params = [hidden, weight, b]
    got = grads((coef[0] * logp + coef[1] * ent).sum(), params)
    want = grads((coef[0] * ref_logp + coef[1] * ref_ent).sum(), params)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


def test_logp_only_and_entropy_only_grads():
    hidden, weight, b, targets, coef = make(6, 4, 9)
    params = [hidden, weight, b]
    logp, none = head_logprobs(hidden, weight, b, targets, chunk_rows=4)
    assert none is None
    ref_logp, ref_ent = naive(hidden, weight, b, targets)
    for g, w in zip(grads((coef[0] * logp).sum(), params), grads((coef[0] * ref_logp).sum(), params)):
        torch.testing.assert_close(g, w)
    # Only the entropy feeds the loss: the logp grad arrives as None.
    _, ent = head_logprobs(hidden, weight, b, targets, chunk_rows=4, with_entropy=True)
    _, ref_ent = naive(hidden, weight, b, targets)
    for g, w in zip(grads((coef[1] * ent).sum(), params), grads((coef[1] * ref_ent).sum(), params)):
        torch.testing.assert_close(g, w)


def test_chunk_invariance():
    hidden, weight, b, targets, coef = make(13, 8, 17, dtype=torch.float32, seed=1)
    outs = []
    for chunk_rows in (1, 2, 5, 13, 64):
        logp, ent = head_logprobs(hidden, weight, b, targets, temperature=1.3, chunk_rows=chunk_rows, with_entropy=True)
        outs.append((logp, ent, grads((coef[0] * logp + coef[1] * ent).sum(), [hidden, weight, b])))
    for logp, ent, g in outs[1:]:
        torch.testing.assert_close(logp, outs[0][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(ent, outs[0][1], atol=1e-6, rtol=0)
        for a, c in zip(g, outs[0][2]):
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)  # grad_W / grad_b sums change order with chunking


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck(with_entropy, bias):
    hidden, weight, b, targets, _ = make(4, 3, 5, bias=bias, seed=2)

    def fn(h, w, *rest):
        logp, ent = head_logprobs(h, w, rest[0] if rest else None, targets, temperature=1.5, chunk_rows=3, with_entropy=with_entropy)
        return (logp, ent) if with_entropy else logp

    assert torch.autograd.gradcheck(fn, tuple(t for t in (hidden, weight, b) if t is not None))


def saved_bytes(fn):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_graph_does_not_keep_logits():
    n, h, v = 2048, 64, 8192
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / 8).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    logits_bytes = n * v * 4
    chunked = saved_bytes(lambda: head_logprobs(hidden, weight, None, targets, chunk_rows=256, with_entropy=True))
    assert chunked < logits_bytes / 4
    # Naive logp only (cheaper than with entropy): log_softmax alone saves its full (N, V) output.
    full = saved_bytes(lambda: torch.log_softmax(F.linear(hidden, weight), dim=-1).gather(1, targets[:, None]))
    assert full >= logits_bytes


def test_tied_embedding_weight():
    v, h, n = 10, 6, 8
    torch.manual_seed(4)
    emb = torch.nn.Embedding(v, h, dtype=torch.float64)
    proj = torch.nn.Linear(h, h, dtype=torch.float64)
    ids = torch.randint(0, v, (n,))
    targets = torch.roll(ids, -1)

    def run(head):
        emb.zero_grad(), proj.zero_grad()
        hidden = torch.tanh(proj(emb(ids)))
        logp, ent = head(hidden, emb.weight, None, targets)
        (logp.sum() - 0.3 * ent.sum()).backward()
        return emb.weight.grad.clone(), proj.weight.grad.clone()

    got = run(lambda *a: head_logprobs(*a, chunk_rows=3, with_entropy=True))
    want = run(naive)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_empty_rows():
    hidden, weight, b, targets, _ = make(0, 4, 6, dtype=torch.float32)
    logp, ent = head_logprobs(hidden, weight, b, targets, with_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,) and logp.dtype == torch.float32
    gh, gw, gb = grads(logp.sum() + ent.sum(), [hidden, weight, b])
    assert gh.shape == (0, 4) and not gw.any() and not gb.any()


def test_low_precision_inputs():
    hidden, weight, b, targets, coef = make(5, 8, 12, dtype=torch.bfloat16, seed=5)
    logp, ent = head_logprobs(hidden, weight, b, targets, chunk_rows=2, with_entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    logits = F.linear(hidden, weight, b).float()  # the head's matmul in bf16, as the model's own head; the softmax in fp32
    logsm = torch.log_softmax(logits, -1)
    ref_logp, ref_ent = logsm.gather(1, targets[:, None]).squeeze(1), -(logsm.exp() * logsm).sum(-1)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    gh, gw, gb = grads((coef[0].float() * logp).sum(), [hidden, weight, b])
    assert (gh.dtype, gw.dtype, gb.dtype) == (torch.bfloat16,) * 3


def test_needs_input_grad_subset():
    hidden, weight, b, targets, coef = make(5, 4, 7, seed=6)
    weight.requires_grad_(False)
    logp, _ = head_logprobs(hidden, weight, b, targets, chunk_rows=2)
    ref, _ = naive(hidden, weight, b, targets)
    got = grads((coef[0] * logp).sum(), [hidden, b])
    want = grads((coef[0] * ref).sum(), [hidden, b])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_gather_rows():
    hidden = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    source = torch.tensor([0, 4, 5, 2])
    out = gather_rows(hidden, source)
    assert out.shape == (4, 4)
    torch.testing.assert_close(out, torch.stack([hidden[0, 0], hidden[1, 1], hidden[1, 2], hidden[0, 2]]))
