"""bf16 asked for on a CPU without fast bf16 matmuls (an AVX2-only CPU: torch's generic bf16 GEMM ran at 2 GFLOP/s
against 114 in fp32 on an EPYC Zen 3) warns once per setting, naming it; where the matmuls are fast, nothing."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from alignflow.stages.common import models


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(models, "_warned_bf16", set())
    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: False)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == models.__name__ and r.levelno == logging.WARNING]


def test_a_cpu_without_fast_bf16_warns_once_per_setting_naming_it(monkeypatch, caplog):
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger=models.__name__):
        for _ in range(2):
            models.warn_if_bf16_is_slow("deepspeed.precision: bf16")
        models.warn_if_bf16_is_slow("model.dtype: bfloat16")
    said = warnings_of(caplog)
    assert len(said) == 2
    assert said[0].startswith("deepspeed.precision: bf16: ") and "slower than fp32" in said[0]
    assert said[1].startswith("model.dtype: bfloat16: ")


def test_no_warning_where_bf16_matmuls_are_fast_or_on_a_gpu(monkeypatch, caplog):
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: True)
    with caplog.at_level(logging.WARNING, logger=models.__name__):
        models.warn_if_bf16_is_slow("deepspeed.precision: bf16")
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(models.torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger=models.__name__):
        models.warn_if_bf16_is_slow("deepspeed.precision: bf16")
    assert warnings_of(caplog) == []


WIRING = textwrap.dedent("""
    import sys
    from alignflow.config.base import BatchConfig, DeepSpeedConfig, ModelConfig, OptimConfig
    from alignflow.stages.common import models
    from alignflow.stages.common.strategy import Strategy

    models.cpu_has_fast_bf16 = lambda: False  # as on an AVX2-only CPU, whatever this one has
    Strategy(DeepSpeedConfig(precision=sys.argv[1]), BatchConfig(global_batch_size=2, micro_batch_size=2), OptimConfig())
    models.load_causal_lm("builtin:tiny", ModelConfig(dtype=sys.argv[2]))
""")


@pytest.mark.parametrize("precision,dtype,expected", [("bf16", "bfloat16", ["deepspeed.precision: bf16", "model.dtype: bfloat16"]),
                                                      ("fp32", "float32", [])])
def test_the_strategy_and_the_loader_ask(precision, dtype, expected):
    """The real call sites, in a fresh process (the strategy sets up torch.distributed): a bf16 strategy and a bf16
    model load each warn, with the setting; fp32 says nothing."""
    proc = subprocess.run([sys.executable, "-c", WIRING, precision, dtype], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line.split(": this CPU")[0] for line in proc.stderr.splitlines() if "no fast bf16 matmuls" in line]
    assert said == expected, json.dumps(proc.stderr[-2000:])


@pytest.mark.parametrize("dtype,warnings", [("bfloat16", 1), ("float32", 0)])
def test_the_reward_scorer_asks(monkeypatch, caplog, dtype, warnings):
    """RL's reward worker scores in `rl.model.dtype` through RewardScorer: it checks before it loads."""
    from alignflow.stages.common.builtin_model import resolve_builtin
    from alignflow.stages.rm.scoring import RewardScorer

    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger=models.__name__):
        with pytest.raises(ValueError, match="not a reward model"):  # builtin:tiny is a causal LM, refused once loaded
            RewardScorer(resolve_builtin("builtin:tiny"), dtype=dtype)
    assert len(warnings_of(caplog)) == warnings
