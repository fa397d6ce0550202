"""The OpenAI-compatible endpoint in front of a rollout engine (the HF one on the tiny model), driven by the real
`openai` client over real HTTP: concurrent episodes are batched, every call is recorded in the engine's own token
ids and log-probs, and foreign keys and model names get clear errors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from alignflow.config.base import ModelConfig
from alignflow.stages.common.generation import HFGenerator, SamplingParams
from alignflow.stages.common.models import load_causal_lm, load_tokenizer
from alignflow.stages.rl.openai_server import OpenAIServer, stop_cut


@pytest.fixture(scope="module")
def endpoint(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    engine = HFGenerator(load_causal_lm(tiny_model_path, ModelConfig(name_or_path=tiny_model_path)), tokenizer.eos_token_id,
                         tokenizer.pad_token_id)
    engine_calls = []

    def generate(prompts, params):
        out = engine.generate(prompts, params)
        engine_calls.append((prompts, params, out))
        return out

    server = OpenAIServer(tokenizer, generate, model_name="policy", sampling=SamplingParams(10, temperature=1.0), window_s=0.2)
    yield server, tokenizer, engine_calls
    server.close()


def two_turns(server: OpenAIServer, episode: str) -> str:
    client = openai.OpenAI(base_url=server.url, api_key=episode, max_retries=0)
    first = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12+34"}], max_tokens=6)
    answer = first.choices[0].message.content
    stream = client.chat.completions.create(model="policy", stream=True, messages=[
        {"role": "user", "content": "12+34"}, {"role": "assistant", "content": answer}, {"role": "user", "content": "again"}])
    return answer + "|" + "".join(chunk.choices[0].delta.content or "" for chunk in stream)


def test_concurrent_episodes_are_batched_and_recorded_in_the_engines_ids(endpoint):
    server, tokenizer, engine_calls = endpoint
    engine_calls.clear()
    episodes = [server.book.open() for _ in range(6)]
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda e: two_turns(server, e), episodes))
    assert len(engine_calls) < 12  # 12 requests, batched (here: 2 or 3 generate calls)
    sampled = {(tuple(p), tuple(r.response_ids)): r.logprobs for prompts, params, out in engine_calls
               for p, r in zip([q for q in prompts for _ in range(params.n)], out)}
    for episode, text in zip(episodes, texts):
        calls = server.book.close(episode)
        assert len(calls) == 2
        for call in calls:  # the exact ids and log-probs the engine sampled
            assert sampled[(tuple(call.prompt_ids), tuple(call.response_ids))] == call.logprobs
        assert calls[0].finish_reason == "length" or calls[0].response_ids[-1] == tokenizer.eos_token_id
        assert len(calls[0].response_ids) <= 6 and len(calls[1].response_ids) <= 10  # max_tokens, then the stage's cap
        assert text == "|".join(tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in calls)


def test_completions_honour_n_and_stop_strings_with_ids_that_match_the_text(endpoint):
    server, tokenizer, _ = endpoint
    episode = server.book.open()
    client = openai.OpenAI(base_url=server.url, api_key=episode, max_retries=0)
    out = client.completions.create(model="policy", prompt="12+34=", n=3, stop=["a", "e"])
    calls = server.book.close(episode)
    assert len(out.choices) == len(calls) == 3
    for choice, call in zip(out.choices, calls):
        assert "a" not in choice.text and "e" not in choice.text
        full = tokenizer.decode(call.response_ids, skip_special_tokens=True)
        assert full.startswith(choice.text) and len(call.logprobs) == len(call.response_ids)
        assert choice.finish_reason == call.finish_reason


def test_a_foreign_key_or_model_name_is_refused_by_name(endpoint):
    server, _, _ = endpoint
    with pytest.raises(openai.AuthenticationError, match="the API key must be the episode id"):
        openai.OpenAI(base_url=server.url, api_key="sk-not-an-episode", max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}])
    episode = server.book.open()
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' is not served here: use 'policy'"):
        openai.OpenAI(base_url=server.url, api_key=episode, max_retries=0).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert server.book.close(episode) == []
    assert [m.id for m in openai.OpenAI(base_url=server.url, api_key="any").models.list().data] == ["policy"]


def test_stop_cut_ends_the_ids_at_the_token_that_completes_the_stop_string(tokenizer):
    ids = tokenizer("12+34=46 end", add_special_tokens=False)["input_ids"]
    cut, text, found = stop_cut(tokenizer, ids, ["=4"])
    assert found and text == "12+34" and tokenizer.decode(cut).endswith("=4") and not tokenizer.decode(cut[:-1]).endswith("=4")
    assert stop_cut(tokenizer, ids, ["xyz"]) == (ids, "12+34=46 end", False)
