import pytest

from alignflow.config.base import OptimConfig
from alignflow.stages.common.strategy import lr_lambda


def test_warmup_then_cosine_to_floor():
    f = lr_lambda(OptimConfig(warmup_steps=4, min_lr_ratio=0.1), total_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_constant_schedule():
    f = lr_lambda(OptimConfig(scheduler="constant"), total_steps=10)
    assert {f(s) for s in range(10)} == {1.0}
