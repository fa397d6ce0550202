"""Remote rewards over real HTTP: a small reward service in the test (it scores, fails on purpose, or hangs),
`alignflow reward-server` serving the tiny reward model, and a GRPO stage scoring through `reward.url`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

from alignflow.exit_codes import SERVICE_UNAVAILABLE
from alignflow.infra.ports import free_port
from alignflow.stages.rl.remote import RemoteReward, ServiceUnavailable
from alignflow.stages.rl.rewards import RewardError

from .conftest import ROOT, history

TOKEN = "s3cret-token-value"
PROMPTS = ["01+02", "10+20", "03+04", "05+05", "11+11", "07+01", "02+02"]
COMPLETIONS = ["3", "30", "8", "10", "22", "9", "4"]


def exact_answer(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(int(p[:2]) + int(p[3:]) == int(c)) if c.strip().isdigit() else 0.0 for p, c in zip(prompts, completions)]


class RewardService:
    """A reward service on 127.0.0.1: `mode` says how it answers; every request is recorded."""

    def __init__(self):
        self.mode, self.failures_left, self.requests = "ok", 0, []
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append({"body": body, "auth": self.headers.get("Authorization")})
                mode = service.mode
                if mode == "fail_then_ok" and service.failures_left > 0:
                    service.failures_left -= 1
                    return self.reply(503, {"error": "warming up"})
                if mode == "down":
                    return self.reply(503, {"error": "overloaded"})
                if mode == "reject":
                    return self.reply(422, {"error": "prompts must not be empty"})
                if mode == "hang":
                    time.sleep(3)
                scores = exact_answer(body["prompts"], body["completions"])
                if mode == "short":
                    scores = scores[:-1]
                if mode == "nan" and scores:
                    scores[-1] = "NaN"
                self.reply(200, {"scores": scores})

            def reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def service():
    s = RewardService()
    yield s
    s.server.shutdown()


def remote(url, **kw):
    opts = dict(timeout_s=1.0, retries=2, backoff_s=0.05, batch_size=2, concurrency=3, auth_env=None) | kw
    return RemoteReward(url, **opts)


def call(reward, n=len(PROMPTS)):
    ids = [[1, 2]] * n
    return reward(PROMPTS[:n], COMPLETIONS[:n], ids, ids, {"answer": list(range(n))})


def test_scores_come_back_in_order_over_concurrent_batches_with_the_token(service, monkeypatch):
    service.mode, service.requests[:] = "ok", []
    monkeypatch.setenv("REWARD_TOKEN", TOKEN)
    scores = call(remote(service.url, auth_env="REWARD_TOKEN"))
    assert scores.tolist() == exact_answer(PROMPTS, COMPLETIONS) and scores.dtype == torch.float32
    assert len(service.requests) == 4 and {r["auth"] for r in service.requests} == {f"Bearer {TOKEN}"}  # 7 samples, 2 a batch
    assert sorted(sum((r["body"]["prompts"] for r in service.requests), [])) == sorted(PROMPTS)
    assert all(set(r["body"]) == {"prompts", "completions", "prompt_ids", "completion_ids", "columns"} for r in service.requests)


def test_transient_failures_are_retried_with_backoff(service):
    service.mode, service.failures_left, service.requests[:] = "fail_then_ok", 2, []
    assert call(remote(service.url, concurrency=1, batch_size=8)).tolist() == exact_answer(PROMPTS, COMPLETIONS)
    assert len(service.requests) == 3


@pytest.mark.parametrize("mode, expected", [("down", "HTTP 503"), ("hang", "no reply within 1 s"), ("closed", "ConnectError")])
def test_a_service_down_for_good_is_named_with_its_status_and_not_the_token(service, monkeypatch, mode, expected):
    service.mode, service.requests[:] = mode, []
    monkeypatch.setenv("REWARD_TOKEN", TOKEN)
    url = f"http://127.0.0.1:{free_port()}/score" if mode == "closed" else service.url
    with pytest.raises(ServiceUnavailable) as err:
        call(remote(url, auth_env="REWARD_TOKEN", batch_size=8), n=2)
    message = str(err.value)
    assert url in message and expected in message and "3 attempts" in message and TOKEN not in message
    assert len(service.requests) == (0 if mode == "closed" else 3)


@pytest.mark.parametrize("mode, expected", [("reject", "answered HTTP 422"), ("short", "returned 2 values for 3 samples"),
                                            ("nan", "returned 'NaN' for sample 2 (prompt '03+04', completion '8')")])
def test_a_refused_request_or_a_bad_reply_is_bad_input_naming_the_sample(service, mode, expected):
    service.mode = mode
    with pytest.raises(RewardError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        call(remote(service.url, batch_size=8), n=3)


def test_a_missing_token_variable_is_named(service, monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    with pytest.raises(RewardError, match="reward.http.auth_env=NO_SUCH_TOKEN: the environment variable is not set"):
        remote(service.url, auth_env="NO_SUCH_TOKEN")


@contextmanager
def reward_server(*args, env=None):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "alignflow.cli", "reward-server", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "no start"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_reward_server_scores_like_the_local_reward_model(tiny_rm, tokenizer):
    from alignflow.stages.rm.scoring import RewardScorer

    _, rm = tiny_rm
    env = {**os.environ, "RM_TOKEN": TOKEN}
    with reward_server("--model", rm["uri"], "--auth-env", "RM_TOKEN", env=env) as url:
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        completion_ids = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for c in COMPLETIONS]
        os.environ["RM_TOKEN"] = TOKEN
        try:
            served = remote(url + "/score", auth_env="RM_TOKEN")(PROMPTS, COMPLETIONS, prompt_ids, completion_ids, {})
        finally:
            del os.environ["RM_TOKEN"]
        unauthorized = httpx.post(url + "/score", json={"prompts": [], "completions": []})
        malformed = httpx.post(url + "/score", json={"prompts": ["a"], "completions": []}, headers={"Authorization": f"Bearer {TOKEN}"})
    local = RewardScorer(os.path.join(rm["uri"], "model"), normalize=True).score_ids([p + c for p, c in zip(prompt_ids, completion_ids)])
    assert torch.allclose(served, local, atol=1e-5) and served.std() > 0
    assert unauthorized.status_code == 401
    assert malformed.status_code == 400 and "completions has 0 entries for 1 prompts" in malformed.json()["error"]


def rl_config(root, url, *overrides):
    from .conftest import QUIET
    from alignflow.config import load_config

    return load_config(ROOT / "configs" / "tiny.yaml", [f"storage.root={root}", *QUIET, "rl.from=sft", "rl.reward.function=null",
                                                        f"rl.reward.url={url}", "rl.reward.http.backoff_s=0.05", *overrides])


@pytest.mark.usefixtures("ray_session")
def test_grpo_scores_its_samples_with_the_reward_service(tiny_sft, service, tmp_path):
    from alignflow.stages.rl.stage import main

    _, sft = tiny_sft
    service.mode, service.requests[:] = "ok", []
    cfg = rl_config(tmp_path, service.url, "rl.batch.max_steps=1", "rl.logging.eval_every=100", "rl.reward.http.batch_size=1000")
    result = main(cfg, "rl", None, {"from": sft["uri"]})
    rl = cfg.section("rl")
    per_step = rl.rollout.prompts_per_step * rl.generation.n_samples_per_prompt
    bodies = [r["body"] for r in service.requests]
    assert bodies[0]["prompts"] == []  # the check before any worker starts
    steps = [r for r in history(result["uri"]) if "reward/mean" in r]
    first_step = next(b for b in bodies if len(b["prompts"]) == per_step)  # the held-out evaluation comes before it
    assert all(len(ids) > 0 for ids in first_step["completion_ids"]) and "answer" in first_step["columns"]
    assert math.isclose(steps[0]["reward/mean"], sum(exact_answer(first_step["prompts"], first_step["completions"])) / per_step,
                        abs_tol=1e-6)


def test_a_service_that_is_down_fails_the_stage_with_the_retryable_exit_code(tiny_sft, tmp_path, capsys):
    from alignflow.stages.common.entry import run_stage_cli

    _, sft = tiny_sft
    url = f"http://127.0.0.1:{free_port()}/score"
    cfg_file = tmp_path / "rl.yaml"
    cfg_file.write_text(f"base: {ROOT / 'configs' / 'tiny.yaml'}\nrl:\n  from: sft\n  reward:\n    function: null\n    url: {url}\n"
                        "    http: {retries: 1, backoff_s: 0.05}\n")
    code = run_stage_cli(["--config", str(cfg_file), "--stage", "rl", "--set", f"storage.root={tmp_path}", "--input", f"from={sft['uri']}"])
    assert code == SERVICE_UNAVAILABLE
    assert f"error: reward service {url} is unavailable: 2 attempts failed" in capsys.readouterr().err
