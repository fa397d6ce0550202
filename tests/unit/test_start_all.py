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
