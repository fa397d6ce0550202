"""Agents in the user's code (`stages/rl/agents.py`) against the real OpenAI-compatible endpoint with the real
`openai` client: episodes of several calls are trained on the engine's own ids and log-probs (also under a chat
template that re-renders earlier turns), agents that raise, hang, never call or name a foreign model are dropped
and counted or stop the stage naming the row. (GRPO on configs/tiny-agent.yaml's agent through `alignflow run`:
tests/e2e/test_graphs.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from alignflow.config.base import ModelConfig
from alignflow.stages.common.generation import HFGenerator, SamplingParams
from alignflow.stages.common.models import load_causal_lm, load_tokenizer
from alignflow.stages.rl.agents import AgentExecutor
from alignflow.stages.rl.data import PromptRow
from alignflow.stages.rl.experience import Experience, response_logprobs
from alignflow.stages.rl.openai_server import OpenAIServer
from alignflow.stages.rl.rewards import RewardError


# Earlier assistant turns rendered as "..." (as templates that drop a reasoning model's earlier thinking do): a
# later call's prompt does not extend the tokens sampled before it.
STRIPPING = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
             "{{ '<|assistant|>...<|end|>' }}{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
ROWS = [PromptRow(text=p, ids=[], columns={"answer": a}) for p, a in (("12+34", "46"), ("rev abcd", "dcba"), ("50+50", "100"))]


def three_calls(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    for reply in ("wrong", "again"):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=6).choices[0].message.content
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": reply}]
    last = client.chat.completions.create(model="policy", messages=messages, max_tokens=6).choices[0].message.content
    return {"reward": float(last == row["answer"]), "length": len(last)}


def action_runs(rollout) -> list[tuple[list[int], list[float]]]:
    """The row's maximal runs of sampled tokens (mask 1), with their log-probs."""
    runs, inside = [], False
    for token, logp, action in zip(rollout.response_ids, rollout.logprobs, rollout.action_mask):
        if action and not inside:
            runs.append(([], []))
        if action:
            runs[-1][0].append(token)
            runs[-1][1].append(logp)
        inside = bool(action)
    return runs


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    model = load_causal_lm(tiny_model_path, ModelConfig(name_or_path=tiny_model_path))
    return model, HFGenerator(model, *(lambda t: (t.eos_token_id, t.pad_token_id))(load_tokenizer(tiny_model_path)))


def endpoint(engine, tokenizer, sampled):
    def generate(prompts, params):
        out = engine[1].generate(prompts, params)
        sampled.extend(out)
        return out

    return OpenAIServer(tokenizer, generate, model_name="policy", sampling=SamplingParams(6), window_s=0.05)


@pytest.mark.parametrize("template", ["shipped", "stripping"])
def test_episodes_train_on_the_engines_ids_and_logprobs(engine, tiny_model_path, template):
    tokenizer = load_tokenizer(tiny_model_path)
    if template == "stripping":
        tokenizer.chat_template = STRIPPING
    sampled = []
    server = endpoint(engine, tokenizer, sampled)
    try:
        episodes = AgentExecutor(server, three_calls, "three_calls", concurrency=4, timeout_s=60,
                                 max_dropped_fraction=0).run(ROWS, SamplingParams(6, temperature=1.0, n=2, seed=5))
    finally:
        server.close()
    assert len(episodes.rollouts) == 6 and bool(episodes.present.all()) and episodes.stats["agent/calls"].tolist() == [3.0] * 6
    engine_tokens = {tuple(r.response_ids): r.logprobs for r in sampled}
    for rollout in episodes.rollouts:
        runs = action_runs(rollout)
        assert len(runs) == 3  # each call's sampled tokens, as the engine sampled them, with its log-probs
        assert all(engine_tokens[tuple(ids)] == logps for ids, logps in runs)
        if template == "stripping":  # re-rendered turns: each call its own segment (tests/unit/test_agent_rows.py: when)
            assert rollout.position_ids is not None and rollout.position_ids.count(0) == 3
    exp = Experience.from_rollouts(episodes.rollouts, tokenizer.pad_token_id)
    with torch.no_grad():
        trained, _ = response_logprobs(engine[0], exp, temperature=1.0)
    # The training forward sees each sampled token in the context it was sampled in: the same log-probs.
    assert float(((trained - exp.sampled_logp).abs() * exp.mask).max()) < 1e-4


def test_async_agents_run_too(engine, tiny_model_path):
    async def one_call(client, row):
        reply = await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=4)
        await asyncio.sleep(0)
        return float(len(reply.choices[0].text))

    server = endpoint(engine, load_tokenizer(tiny_model_path), [])
    try:
        episodes = AgentExecutor(server, one_call, "one_call", concurrency=3, timeout_s=60, max_dropped_fraction=0).run(
            ROWS, SamplingParams(4, n=2))
    finally:
        server.close()
    assert episodes.stats["agent/calls"].tolist() == [1.0] * 6 and episodes.rollouts[0].action_mask is None


def misbehaving(client, row):
    kind = row["kind"]
    if kind == "raises":
        raise ValueError("tool crashed")
    if kind == "hangs":
        time.sleep(30)
    if kind == "foreign model":
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    if kind != "never calls":
        client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
    return 10 ** 400 if kind == "huge" else 1.0


def test_agents_that_raise_hang_never_call_or_name_a_foreign_model(engine, tiny_model_path):
    kinds = ["raises", "hangs", "never calls", "foreign model", "fine"]
    rows = [PromptRow(text=f"1{k}+1", ids=[], columns={"kind": kind}) for k, kind in enumerate(kinds)]
    server = endpoint(engine, load_tokenizer(tiny_model_path), [])
    try:
        run = lambda fraction: AgentExecutor(server, misbehaving, "misbehaving", concurrency=5, timeout_s=2,  # noqa: E731
                                             max_dropped_fraction=fraction).run(rows, SamplingParams(2, n=1))
        started = time.monotonic()
        episodes = run(1.0)
        assert time.monotonic() - started < 15  # the hung episode is given up at its timeout
        assert episodes.present.tolist() == [False, False, False, False, True]
        assert episodes.stats["agent/dropped_fraction"].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
        assert episodes.scores.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
        with pytest.raises(RewardError) as err:
            run(0.5)
    finally:
        server.close()
    message = str(err.value)
    assert "4 of 5 episodes dropped" in message and "row 0 (prompt '10+1'): raised ValueError: tool crashed" in message


def test_dropped_reasons_are_named(engine, tiny_model_path):
    server = endpoint(engine, load_tokenizer(tiny_model_path), [])
    try:
        for kind, reason in (("hangs", "timed out after 2 s"), ("never calls", "returned without calling the model"),
                             ("huge", "returned reward 1000"),
                             ("foreign model", "model 'gpt-4o' is not served here: use 'policy'")):
            rows = [PromptRow(text="1+1", ids=[], columns={"kind": kind})]
            with pytest.raises(RewardError, match=reason):
                AgentExecutor(server, misbehaving, "m", concurrency=1, timeout_s=2, max_dropped_fraction=0).run(rows, SamplingParams(2))
    finally:
        server.close()


def test_an_engine_failure_fails_the_step_not_the_agent(tiny_model_path):
    def broken(prompts, params):
        raise RuntimeError("a rollout engine died")

    server = OpenAIServer(load_tokenizer(tiny_model_path), broken, model_name="policy", sampling=SamplingParams(2))
    try:
        with pytest.raises(RuntimeError, match="a rollout engine died"):  # retryable, unlike a RewardError (bad input)
            AgentExecutor(server, misbehaving, "m", concurrency=2, timeout_s=30, max_dropped_fraction=1.0).run(
                [PromptRow(text="1+1", ids=[], columns={"kind": "fine"})], SamplingParams(2, n=2))
    finally:
        server.close()
