"""Scoring with a published reward model: what the RL stage (and anyone else) calls.

    scorer = RewardScorer("outputs/tiny/rm/<key>/model", normalize=True)
    scorer.score(["07+45"], ["52"])           # prompts and responses, formatted as in training
    scorer.score_ids([[1, 5, 9, ...]])         # token ids of prompt + response (+ EOS), as generated

Scores are read at the last non-padding token, exactly as in training. With `normalize`,
scores are (s - mean) / std with the mean and std the rm stage stored in config.json.
"""

from __future__ import annotations

import torch

from alignflow.stages.common.data import chat_prompt_text
from alignflow.stages.common.models import REWARD_MEAN, REWARD_STD, load_dtype, transformers_without_unused_extras


class RewardScorer:
    def __init__(self, path: str, device: str | torch.device = "cpu", dtype: str = "float32", normalize: bool = False,
                 batch_size: int = 64):
        transformers_without_unused_extras()
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=load_dtype(dtype)).to(device).eval()
        config = self.model.config
        if config.num_labels != 1 or config.pad_token_id is None:
            raise ValueError(f"{path}: not a reward model (needs num_labels=1 and a pad_token_id; got {config.num_labels}, {config.pad_token_id})")
        self.device, self.batch_size, self.pad_id = torch.device(device), batch_size, config.pad_token_id
        self.mean, self.std = getattr(config, REWARD_MEAN, None), getattr(config, REWARD_STD, None)
        if normalize and (self.mean is None or not self.std):
            raise ValueError(f"{path}: normalize=True, but its config.json has no {REWARD_MEAN}/{REWARD_STD} (not published by the rm stage?)")
        self.normalize = normalize

    def text(self, prompt: str, response: str) -> str:
        """The text the reward model was trained on for (prompt, response)."""
        return chat_prompt_text(self.tokenizer, prompt) + response + self.tokenizer.eos_token

    def score(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return self.score_texts([self.text(p, r) for p, r in zip(prompts, responses)])

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """Scores of fully formatted texts (prompt template, response and EOS included)."""
        return self.score_ids([self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]]) -> torch.Tensor:
        """(N,) float32 scores of token-id sequences, right-padded in batches."""
        out = []
        for k in range(0, len(sequences), self.batch_size):
            chunk = sequences[k:k + self.batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for b, seq in enumerate(chunk):
                ids[b, :len(seq)], mask[b, :len(seq)] = torch.tensor(seq), 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            out.append(logits[:, 0].float().cpu())
        scores = torch.cat(out) if out else torch.zeros(0)
        return (scores - self.mean) / self.std if self.normalize else scores
