"""The Hugging Face generator: what it samples, the log-probs it reports, and when it stops."""

import pytest
import torch

from alignflow.stages.common.generation import HFGenerator, SamplingParams, sample


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


def prompts(tokenizer, *texts):
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for t in texts]


def test_greedy_matches_transformers_generate_and_logprobs_match_a_forward(model, tokenizer):
    gen = HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    batch = prompts(tokenizer, "12+34", "rev abcd", "x")  # different lengths: left padding must not matter
    rollouts = gen.generate(batch, SamplingParams(max_new_tokens=6, temperature=0))
    for p, r in zip(batch, rollouts):
        ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)[0, len(p):].tolist()
        assert r.response_ids == ref[:len(r.response_ids)] and r.prompt_ids == p
        assert r.finish_reason == ("stop" if tokenizer.eos_token_id in r.response_ids else "length")
        with torch.no_grad():
            logits = model(torch.tensor([p + r.response_ids])).logits[0, len(p) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r.response_ids).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=0)


def test_sampling_is_seeded_grouped_and_temperature_scaled(model, tokenizer):
    gen = HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, batch_size=5)
    params = SamplingParams(max_new_tokens=5, temperature=0.7, n=4, seed=3)
    batch = prompts(tokenizer, "12+34", "rev abcd")
    a, b = gen.generate(batch, params), gen.generate(batch, params)
    assert len(a) == 8 and [r.prompt_ids for r in a] == [batch[0]] * 4 + [batch[1]] * 4
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    r = a[5]
    with torch.no_grad():
        logits = model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0, len(r.prompt_ids) - 1:-1] / 0.7
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r.response_ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=0)


def test_top_k_and_top_p_truncate():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, SamplingParams(1, top_k=2), g)) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample(logits, SamplingParams(1, top_p=0.7), g)) for _ in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert {int(sample(logits, SamplingParams(1, top_p=0.4), g)) for _ in range(50)} == {0}


def test_weights_load_into_the_generator(model, tokenizer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    gen = HFGenerator(other, tokenizer.eos_token_id, tokenizer.pad_token_id)
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    gen.load_weights(state)
    assert torch.equal(other.state_dict()["lm_head.weight"], state["lm_head.weight"])
    with pytest.raises(RuntimeError, match="weights do not fit the generator"):
        gen.load_weights({"nope": torch.zeros(1)})


def test_each_prompt_is_prefilled_once_for_its_n_samples(model, tokenizer):
    gen = HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, batch_size=6)  # 2 prompts x 3 per call
    batch = prompts(tokenizer, "12+34", "rev abcd", "x")
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        grouped = gen.generate(batch, SamplingParams(max_new_tokens=4, temperature=0, n=3))
    finally:
        hook.remove()
    prefills = [s for s in shapes if s[1] > 1]
    assert [s[0] for s in prefills] == [2, 1]  # the prompts, not their 9 samples
    single = gen.generate(batch, SamplingParams(max_new_tokens=4, temperature=0))
    for k, r in enumerate(grouped):  # greedy: every sample of a prompt is that prompt's one greedy answer
        assert r.prompt_ids == single[k // 3].prompt_ids and r.response_ids == single[k // 3].response_ids
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(single[k // 3].logprobs), atol=1e-5, rtol=0)
