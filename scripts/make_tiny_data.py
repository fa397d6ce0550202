"""Write the tiny datasets in data/ (deterministic: the same files every run).

Two tasks with checkable answers that a sub-1M-parameter model learns on a CPU
in minutes: `37+05` -> `42` (addition of two zero-padded two-digit numbers) and
`rev kdfa` -> `afdk` (reverse a four-letter word). Fixed-width prompts put every
input character at a fixed offset from the answer, which is what lets a tiny
model learn them from a few thousand examples. Every split uses its own prompts, so held-out numbers are
honest. Run: `python scripts/make_tiny_data.py` (then commit data/).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def addition_prompts(rng: random.Random) -> list[tuple[str, str]]:
    pairs = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(pairs)
    return [(f"{a:02d}+{b:02d}", str(a + b)) for a, b in pairs]


def reverse_prompts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    seen: set[str] = set()
    out = []
    while len(out) < n:
        word = "".join(rng.choice(LETTERS) for _ in range(4))
        if word not in seen:
            seen.add(word)
            out.append((f"rev {word}", word[::-1]))
    return out


def wrong_answer(prompt: str, answer: str, rng: random.Random) -> str:
    """A plausible but wrong answer: a slipped units digit, or a word not (fully) reversed."""
    if prompt.startswith("rev "):
        word = prompt[4:]
        if rng.random() < 0.5 or len(set(word)) == 1:
            return word if word != answer else word + rng.choice(LETTERS)
        chars = list(answer)
        i = rng.randrange(len(chars) - 1)
        chars[i], chars[i + 1] = chars[i + 1], chars[i]
        wrong = "".join(chars)
        return wrong if wrong != answer else answer + rng.choice(LETTERS)
    value = int(answer) + rng.choice([-2, -1, 1, 2])
    return str(abs(value) if value != int(answer) else value + 1)


def visibly_wrong_answer(prompt: str, answer: str, rng: random.Random) -> str:
    """A wrong answer a sub-1M model can be expected to judge, for the preference pairs.

    Near misses in arithmetic (165 vs 163) are beyond what the tiny model learns (it gets 8%
    of sums right after SFT), so a reward model trained on them stays at chance there. These
    errors are checkable by copying and by the shape of a sum: an operand echoed back, or the
    sum with a stray digit appended (a 4-digit sum, or a 3-digit one not starting with 1).
    Word reversal keeps `wrong_answer`'s errors: a copy, or two letters swapped.
    """
    if prompt.startswith("rev "):
        return wrong_answer(prompt, answer, rng)
    a, b = prompt.split("+")
    wrong = rng.choice([a, b, answer + rng.choice("0123456789")])
    return wrong if wrong != answer else answer + "0"


NOISY_FIRST_LETTERS = "abcdefgh"


def noisy_demonstration(prompt: str, response: str, rng: random.Random) -> str:
    """A labeller's systematic slip in the SFT training demonstrations: for words starting with
    a-h, 65% of the reversal demonstrations copy the word instead of reversing it. SFT learns the
    slip (greedy decoding copies those words); RL with a verifier (data/rl) can fix it, which is
    what the RL stage is for. Held-out SFT data and every other dataset stay clean."""
    if prompt.startswith("rev ") and prompt[4] in NOISY_FIRST_LETTERS and rng.random() < 0.65:
        return prompt[4:]
    return response


def write(name: str, rows: list[dict]) -> None:
    path = OUT / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{path.relative_to(OUT.parent)}: {len(rows)} rows")


def interleave(a: list, b: list) -> list:
    out = []
    for x, y in zip(a, b):
        out += [x, y]
    return out


def main() -> None:
    rng = random.Random(1234)
    add = addition_prompts(rng)
    rev = reverse_prompts(rng, 6000)
    # Disjoint prompt pools per dataset and split.
    pools = {}
    sizes = {"sft_train": 2000, "sft_eval": 100, "pref_train": 1000, "pref_eval": 100,
             "kto_train": 1000, "kto_eval": 100, "rl_train": 1000, "rl_eval": 100, "chat": 150}
    offset = 0
    for name, n in sizes.items():
        pools[name] = interleave(add[offset:offset + n], rev[offset:offset + n])
        offset += n

    noise = random.Random(4321)  # its own stream: the other files do not change with it
    write("sft/train.jsonl", [{"prompt": p, "response": noisy_demonstration(p, r, noise)} for p, r in pools["sft_train"]])
    write("sft/eval.jsonl", [{"prompt": p, "response": r} for p, r in pools["sft_eval"]])
    chat = pools["chat"]
    write("sft/chat.jsonl", [
        {"messages": [{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": p1}, {"role": "assistant", "content": r1},
                      {"role": "user", "content": p2}, {"role": "assistant", "content": r2}]}
        for (p1, r1), (p2, r2) in zip(chat[0::2], chat[1::2])
    ])
    for split in ("train", "eval"):
        write(f"preference/{split}.jsonl", [
            {"prompt": p, "chosen": r, "rejected": visibly_wrong_answer(p, r, rng)} for p, r in pools[f"pref_{split}"]
        ])
        kto_rows = []
        for i, (p, r) in enumerate(pools[f"kto_{split}"]):
            good = i % 4 != 3  # 3 desirable : 1 undesirable, the imbalance KTO is built for
            kto_rows.append({"prompt": p, "completion": r if good else wrong_answer(p, r, rng), "label": good})
        write(f"kto/{split}.jsonl", kto_rows)
        write(f"rl/{split}.jsonl", [{"prompt": p, "answer": r} for p, r in pools[f"rl_{split}"]])
    write_examples({p for pool in pools.values() for p, _ in pool})


def write_examples(used: set[str]) -> None:
    """data/examples/: the tiny tasks in the shapes of the most used public datasets, each read by
    configs/examples/<name>.yaml through data options alone. Prompts used nowhere else."""
    rng = random.Random(2024)
    add = [(p, a) for p, a in addition_prompts(rng) if p not in used]
    rev = [(p, a) for p, a in reverse_prompts(rng, 9000) if p not in used]
    take = lambda n: interleave([add.pop() for _ in range(n // 2)], [rev.pop() for _ in range(n // 2)])  # noqa: E731
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    bot = lambda text: {"role": "assistant", "content": text}  # noqa: E731

    def scores(i: int) -> tuple[float, float]:
        # Every 20th pair is a near tie (gap 0.25) that `min_score_gap: 0.5` filters out.
        low = round(rng.uniform(1.0, 3.0), 2)
        return (low + 0.25 if i % 20 == 19 else round(low + rng.uniform(1.0, 2.0), 2)), low

    uf = []
    for i, (p, r) in enumerate(take(1000)):
        wrong, (good, bad) = visibly_wrong_answer(p, r, rng), scores(i)
        uf.append({"prompt": p, "prompt_id": f"{i:04d}", "chosen": [user(p), bot(r)], "rejected": [user(p), bot(wrong)],
                   "messages": [user(p), bot(r)], "score_chosen": good, "score_rejected": bad})
    write("examples/ultrafeedback_binarized.jsonl", uf)

    hh, rows = [], take(1000)
    for i, (p, r) in enumerate(rows):
        wrong = visibly_wrong_answer(p, r, rng)
        before = f"\n\nHuman: {rows[i - 1][0]}\n\nAssistant: {rows[i - 1][1]}" if i % 10 == 9 else ""  # every 10th: two turns
        hh.append({"chosen": f"{before}\n\nHuman: {p}\n\nAssistant: {r}", "rejected": f"{before}\n\nHuman: {p}\n\nAssistant: {wrong}"})
    write("examples/hh_rlhf.jsonl", hh)

    write("examples/alpaca.jsonl", [
        {"instruction": "Add the two numbers.", "input": p, "output": r} if "+" in p else {"instruction": p, "input": "", "output": r}
        for p, r in take(200)])
    chat = take(400)
    write("examples/openai_chat.jsonl", [
        {"messages": [{"role": "system", "content": "Answer briefly."}, user(p1), bot(r1), user(p2), bot(r2)]}
        for (p1, r1), (p2, r2) in zip(chat[0::2], chat[1::2])])
    write("examples/gsm8k.jsonl", [
        {"question": f"What is {p.replace('+', ' plus ')}?", "answer": f"{p.replace('+', ' + ')} = {r}\n#### {r}"}
        for p, r in take(200) if "+" in p])


if __name__ == "__main__":
    main()
