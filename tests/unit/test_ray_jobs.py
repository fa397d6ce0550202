from alignflow.infra.ray_jobs import LogTail, failure


def test_log_tail_hands_out_complete_lines_once():
    tail = LogTail()
    assert tail.new_lines("a\nb") == ["a"]  # "b" has no newline yet
    assert tail.new_lines("a\nb") == []
    assert tail.new_lines("a\nbc\nd\n") == ["bc", "d"]
    assert tail.new_lines("a\nbc\nd\n") == []


def test_bad_input_exit_code_is_not_retryable():
    bad = failure("j1", "FAILED", "Job entrypoint command failed with exit code 2, last available logs ...", "x\nerror: bad row")
    assert not bad.retryable and "bad input (not retried)" in str(bad) and "error: bad row" in str(bad)
    died = failure("j2", "FAILED", "Job entrypoint command failed with exit code 1", "Traceback ...")
    assert died.retryable
    stopped = failure("j3", "STOPPED", "Job was intentionally stopped.", "")
    assert stopped.retryable


def test_free_ports_are_distinct():
    from alignflow.infra.ports import free_ports

    ports = free_ports(64)
    assert len(set(ports)) == 64


def test_failure_is_one_paragraph_that_keeps_its_kind_through_pickling():
    import pickle

    log = "\n".join(f"step {i}" for i in range(500)) + "\nerror: data.jsonl:41: missing key 'response'\n"
    bad = failure("j1", "FAILED", "Job entrypoint command failed with exit code 2", log)
    assert str(bad).splitlines()[1:] == ["error: data.jsonl:41: missing key 'response'"] and bad.log == log
    again = pickle.loads(pickle.dumps(bad))
    assert not again.retryable and str(again) == str(bad) and again.job_id == "j1"
    crash = failure("j2", "FAILED", "Job entrypoint command failed with exit code 1", log.replace("error:", "Traceback:"))
    assert crash.retryable and len(str(crash).splitlines()) == 16


class _JobsWhoseAgentComesUpLate:
    """A Jobs API client whose head answers as Ray 2.x's does while its job agent is not registered yet."""

    def __init__(self, refusals: int, error: str = "No available agent to submit job, please try again later."):
        self.refusals, self.error, self.sent = refusals, error, []

    def submit_job(self, **job):
        self.sent.append(job)
        if len(self.sent) <= self.refusals:
            raise RuntimeError(f"Request failed with status code 500: {self.error}.")
        return job["submission_id"]


def test_a_submission_is_sent_again_while_the_heads_job_agent_is_not_up(monkeypatch):
    import time

    import pytest

    from alignflow.infra.ray_jobs import submit_when_agent_is_up

    monkeypatch.setattr(time, "sleep", lambda s: None)
    jobs = _JobsWhoseAgentComesUpLate(refusals=3)
    assert submit_when_agent_is_up(jobs, deadline=time.time() + 60, entrypoint="true", submission_id="j1") == "j1"
    assert jobs.sent == [{"entrypoint": "true", "submission_id": "j1"}] * 4  # the same submission id each time
    late = _JobsWhoseAgentComesUpLate(refusals=10**6)
    with pytest.raises(RuntimeError, match="No available agent"):  # past the deadline: Ray's own error
        submit_when_agent_is_up(late, deadline=time.time() - 1, entrypoint="true", submission_id="j2")
    assert len(late.sent) == 1
    other = _JobsWhoseAgentComesUpLate(refusals=1, error="Job with submission_id j3 already exists")
    with pytest.raises(RuntimeError, match="already exists"):  # any other error: never sent twice
        submit_when_agent_is_up(other, deadline=time.time() + 60, entrypoint="true", submission_id="j3")
    assert len(other.sent) == 1
