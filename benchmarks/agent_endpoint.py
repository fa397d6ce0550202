"""The agent endpoint's overhead: calls through the OpenAI-compatible server (`stages/rl/openai_server.py`, with the
real `openai` client over HTTP) against the same generate calls made on the engine directly.

Run:   .venv/bin/python benchmarks/agent_endpoint.py                 # builtin:tiny, HF engine, 16 new tokens
       .venv/bin/python benchmarks/agent_endpoint.py --quick         # fewer rounds
Options: [--model builtin:tiny|DIR] [--new-tokens 16] [--clients 1,16,64] [--rounds 7] [--window-ms 20]

Shape: `clients` episodes at once, each making one chat call with the same one-turn prompt (a data/rl row through
the chat template); the engine generates exactly `--new-tokens` tokens per call (EOS off: `HFGenerator(eos=-1)`).
- direct: `generator.generate([prompt ids] * clients, params)`: what the RL stage's own executors do per turn;
- endpoint: `clients` threads, each `client.chat.completions.create(...)` with its own episode's key (each episode its own
  `openai.OpenAI` client on one shared connection pool, as the rl stage hands them to agents); the server renders
  the messages, tokenizes, batches the concurrent requests into generate calls (waiting `--window-ms` after the first),
  decodes, records the episode's call, and replies.
Each figure is the median of `--rounds` timed rounds after one warm-up round. "added per round" = endpoint - direct, the
latency an agent's turn pays on top of generation; requests/s = clients / endpoint round time. Both run in this one
process on the same engine, one after the other.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import torch

from alignflow.config.base import ModelConfig
from alignflow.stages.common.builtin_model import resolve_builtin
from alignflow.stages.common.data import chat_prompt_text, encode
from alignflow.stages.common.generation import HFGenerator, SamplingParams
from alignflow.stages.common.models import load_causal_lm, load_tokenizer
from alignflow.stages.rl.openai_server import OpenAIServer

PROMPT = "75+93"


def timed(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--window-ms", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    path = resolve_builtin(args.model) if args.model.startswith("builtin:") else args.model
    tokenizer = load_tokenizer(path)
    engine = HFGenerator(load_causal_lm(path, ModelConfig(name_or_path=path)), eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(args.new_tokens, temperature=1.0)
    server = OpenAIServer(tokenizer, engine.generate, model_name="policy", sampling=params, window_s=args.window_ms / 1000)
    prompt_ids = encode(tokenizer, chat_prompt_text(tokenizer, PROMPT))
    print(f"model {args.model}, HF engine, {args.new_tokens} new tokens per call, torch threads {torch.get_num_threads()}, "
          f"batching window {args.window_ms:g} ms, median of {rounds} rounds\n")
    print("| concurrent episodes | direct generate (s) | through the endpoint (s) | added per round (ms) | requests/s |")
    print("|---:|---:|---:|---:|---:|")
    http = openai.DefaultHttpxClient(limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))  # as the stage's
    try:
        for clients in (int(c) for c in args.clients.split(",")):
            direct = timed(lambda: engine.generate([prompt_ids] * clients, params), rounds)

            def one(_):
                episode = server.book.open()
                client = openai.OpenAI(base_url=server.url, api_key=episode, max_retries=0, http_client=http)
                reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": PROMPT}])
                calls = server.book.close(episode)
                assert len(calls) == 1 and len(calls[0].response_ids) == args.new_tokens, reply

            pool = ThreadPoolExecutor(clients)
            through = timed(lambda: list(pool.map(one, range(clients))), rounds)
            pool.shutdown()
            print(f"| {clients} | {direct:.3f} | {through:.3f} | {1000 * (through - direct):.0f} | {clients / through:.1f} |", flush=True)
    finally:
        http.close()
        server.close()


if __name__ == "__main__":
    main()
