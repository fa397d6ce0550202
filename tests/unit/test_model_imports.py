"""A process that loads models (each RL role's worker, a stage job, the warm stage server that jobs fork from,
`alignflow plan`) does not import scikit-learn or SciPy's optimizers: transformers imports both when installed
(MLflow installs them), and they cost up to 2 s of each such process's start on 2 cores."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

LOADS = textwrap.dedent("""
    import json, sys
    from alignflow.config.base import BatchConfig, DeepSpeedConfig, ModelConfig, OptimConfig
    from alignflow.stages.common import models
    from alignflow.stages.common.strategy import Strategy
    from alignflow.stages.rm.scoring import RewardScorer

    if sys.argv[1] == "plan":  # `alignflow plan`: model shapes on the meta device
        from alignflow import plan
        plan.model_shape("builtin:tiny")
    elif sys.argv[1] == "warm server":  # what a Ray head's warm stage server imports before it takes jobs
        from alignflow.infra.warm import Preloaded
        Preloaded()
    elif sys.argv[1] == "reward scorer":  # the RL reward worker's first transformers import
        try:
            RewardScorer(models.resolve_builtin("builtin:tiny"))
        except ValueError:  # loaded, then refused: builtin:tiny is a causal LM
            pass
    else:  # a trainer's: the ZeRO-3 model context, then the loaders
        strategy = Strategy(DeepSpeedConfig(zero_stage=3), BatchConfig(global_batch_size=2, micro_batch_size=2), OptimConfig())
        with strategy.model_init():
            models.load_causal_lm("builtin:tiny", ModelConfig())
            models.load_reward_model("builtin:tiny", ModelConfig(), 0)
        models.load_tokenizer("builtin:tiny")
    import transformers.generation.candidate_generator, transformers.loss.loss_utils  # what imported them before
    print(json.dumps(sorted(name for name in ("sklearn", "scipy.optimize") if name in sys.modules)))
    import scipy.optimize, sklearn.metrics  # only transformers was told they are absent: a reward function may use them
""")


FIRSTS = ["reward scorer", "trainer", "warm server", "plan"]


@pytest.fixture(scope="module")
def probes():
    """The four fresh processes, started at once (each imports torch, transformers and DeepSpeed: 10-13 s alone)."""
    started = {first: subprocess.Popen([sys.executable, "-c", LOADS, first], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}) for first in FIRSTS}
    yield started
    for proc in started.values():
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("first", FIRSTS)
def test_model_loads_import_neither_scikit_learn_nor_scipy_and_user_code_still_can(probes, first):
    out, err = probes[first].communicate(timeout=300)
    assert probes[first].returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1]) == []
