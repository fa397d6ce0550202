"""An agent for the shipped tiny tasks (data/rl), written with the `openai` package only: what a team would
write against any OpenAI-compatible server. alignflow runs it with GRPO in configs/tiny-agent.yaml.

    run(client, row) -> {"reward": float, "tool_call": 0/1, "tool_ok": 0/1, "retried": 0/1}

The policy gets the task (`75+93`, `rev abcd`). It may answer, or call the calculator by answering
`calc <a>+<b>`: the agent computes the sum and sends `= <sum>` back, and the policy answers again. A wrong
answer gets one more try with a hint (`wrong. hint: starts with 1`), as rewards/tiny_retry_env.py gives.
Reward 1.0 for the exact answer at the end, else 0.0. Every call goes through `client`: alignflow records
its tokens and trains on them.
"""

from __future__ import annotations

import re

MODEL = "policy"  # the name the stage's endpoint serves (rl.agent.model_name)
CALC = re.compile(r"^calc\s*(\d+)\s*\+\s*(\d+)$")


def run(client, row: dict) -> dict:
    messages = [{"role": "user", "content": row["prompt"]}]
    tool_call = tool_ok = retried = 0
    for attempt in range(3):  # the answer, a tool result's answer, a retry
        answer = ask(client, messages)
        call = CALC.match(answer)
        if answer.startswith("calc") and not tool_call:
            tool_call, tool_ok = 1, int(call is not None)
            result = f"= {int(call[1]) + int(call[2])}" if call else "error: use calc <a>+<b>"
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": result}]
            continue
        if answer == row["answer"] or retried:
            break
        retried = 1
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"wrong. hint: starts with {row['answer'][0]}"}]
    return {"reward": float(answer == row["answer"]), "tool_call": tool_call, "tool_ok": tool_ok, "retried": retried}


def ask(client, messages: list[dict]) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    return (reply.choices[0].message.content or "").strip()
