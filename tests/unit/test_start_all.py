"""Services start at once; a failed start stops those that came up."""

import threading
import time

import pytest


class Started:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def stop(self):
        self.log.append(f"stop {self.name}")


def test_services_start_together_in_order_and_a_failure_stops_the_rest():
    from alignflow.infra.services import start_all

    barrier, log = threading.Barrier(3, timeout=5), []

    def start(name, fail=False):
        def run():
            barrier.wait()  # passes only when all three are starting at the same time
            time.sleep(0.01 if name == "a" else 0)
            if fail:
                raise RuntimeError(f"{name} did not come up")
            return Started(name, log)
        return run

    assert [s.name for s in start_all(start("a"), start("b"), start("c"))] == ["a", "b", "c"]
    barrier.reset()
    with pytest.raises(RuntimeError, match="b did not come up"):
        start_all(start("a"), start("b", fail=True), start("c"))
    assert sorted(log) == ["stop a", "stop c"]


def test_ray_processes_get_mkls_reproducible_mode_unless_the_user_chose_one(monkeypatch):
    """Without it, a resumed RL run ended 1e-6 off the uninterrupted run's weights in 3 runs of 3
    (tests/integration/test_rl_stage.py::test_killed_run_resumes_to_the_same_weights)."""
    from alignflow.infra.services import reproducible_math_env

    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert reproducible_math_env() == {"MKL_CBWR": "AUTO"}
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert reproducible_math_env() == {"MKL_CBWR": "COMPATIBLE"}
