import threading
import time

import pytest

from alignflow.infra import lease


def test_one_holder_at_a_time_and_the_second_waits_for_the_first(tmp_path):
    first = lease.acquire(str(tmp_path / "sft" / "k"), timeout_s=30, wait=False)
    with pytest.raises(lease.LeaseHeld, match="is being written by another run"):
        lease.acquire(str(tmp_path / "sft" / "k"), timeout_s=30, wait=False)
    waited = []
    threading.Timer(1.0, first.release).start()
    second = lease.acquire(str(tmp_path / "sft" / "k"), timeout_s=30, wait=True, on_wait=waited.append, poll_s=0.1)
    assert waited == [first.holder] and second.holder != first.holder
    second.release()
    assert not (tmp_path / "sft" / "k" / lease.LEASE_FILE).exists()


def test_a_dead_holders_lease_is_taken_over_at_once(tmp_path, dead_holder):
    held = lease.Lease(str(tmp_path / lease.LEASE_FILE), 600, holder=dead_holder)
    held.renew(every_s=0)
    start = time.monotonic()
    taken = lease.acquire(str(tmp_path), timeout_s=600, wait=True, poll_s=0.1)
    assert time.monotonic() - start < 5 and lease.read(taken.uri)["holder"] == taken.holder


def test_an_unrenewed_lease_goes_stale_for_takers_and_for_the_job(tmp_path):
    held = lease.acquire(str(tmp_path), timeout_s=1.0, wait=False)
    held.holder = "other-host:1:0:x"  # a holder we cannot check by process: only renewals tell
    held.renew(every_s=0)
    watcher = lease.Watcher(held.env())
    assert watcher.lost() is None
    held.renew(every_s=0)
    time.sleep(0.6)
    assert watcher.lost() is None  # renewed since it last looked
    time.sleep(1.2)
    assert "stopped renewing" in watcher.lost()
    taken = lease.acquire(str(tmp_path), timeout_s=1.0, wait=True, poll_s=0.1)
    assert "another run now holds" in watcher.lost()
    taken.release()


def test_the_lease_is_renewed_from_its_own_thread_while_the_caller_blocks(tmp_path):
    held = lease.acquire(str(tmp_path), timeout_s=0.8, wait=False)
    watcher = lease.Watcher(held.env())
    with held.renewing():
        for _ in range(6):  # 1.8 s of a caller blocked elsewhere (a slow Jobs API): more than twice the timeout
            time.sleep(0.3)
            assert watcher.lost() is None
    time.sleep(1.0)
    assert "stopped renewing" in watcher.lost()
    held.release()
