"""Gradient clipping in the training seam (stages/common/strategy.py): with ZeRO-0 in fp32 the Strategy clips with
the norm it takes anyway, and DeepSpeed does not clip again; the update is the one plain torch makes. Run in a
fresh process: it sets up torch.distributed and DeepSpeed."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from alignflow.config.base import BatchConfig, DeepSpeedConfig, OptimConfig
    from alignflow.stages.common.strategy import Strategy

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.full((4, 1), 10.0)
    loss = lambda m, rows: ((m(x[rows]) - y[rows]) ** 2).sum() / 4
    optim = OptimConfig(lr=0.1, scheduler="constant", grad_clip=float(sys.argv[1]))
    strategy = Strategy(DeepSpeedConfig(), BatchConfig(global_batch_size=4, micro_batch_size=2), optim)
    engine = strategy.prepare(model(), total_steps=2)
    for rows in (slice(0, 2), slice(2, 4)):  # two micro-batches: the clip happens once, at the boundary
        strategy.backward(loss(engine, rows) / 2 * 2)  # each micro-batch's share of the step objective
        strategy.step()
    plain = model()
    sum(loss(plain, rows) for rows in (slice(0, 2), slice(2, 4))).backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), optim.grad_clip) if optim.grad_clip else None
    reference = torch.optim.AdamW(plain.parameters(), lr=0.1, betas=optim.betas, eps=optim.eps, weight_decay=0.0)
    reference.step()
    gap = max(float((a - b).abs().max()) for a, b in zip(engine.module.parameters(), plain.parameters()))
    print(json.dumps({"gap": gap, "grad_norm": strategy.grad_norm(), "plain_norm": None if norm is None else float(norm),
                      "deepspeed_clips": engine.gradient_clipping()}))
""")


def run(grad_clip: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(grad_clip)], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_zero0_fp32_clips_once_with_its_own_norm_as_plain_torch_does():
    clipped = run(0.05)
    assert clipped["deepspeed_clips"] == 0.0  # not clipped a second time, by DeepSpeed's loop
    assert clipped["plain_norm"] > 1.0  # far above the bound: the clip matters
    assert abs(clipped["grad_norm"] - clipped["plain_norm"]) < 1e-4 * clipped["plain_norm"]  # reported before clipping
    assert clipped["gap"] < 1e-6, clipped
    unclipped = run(0.0)
    assert unclipped["gap"] < 1e-6, unclipped
