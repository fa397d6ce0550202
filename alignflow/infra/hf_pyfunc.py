"""The registered model's MLflow pyfunc: a Hugging Face folder that generates text or chat replies.

Logged as MLflow "models from code": this file is copied into the model, so loading it needs MLflow,
torch and transformers, not alignflow. Input: a table with a `messages` column (a chat: a list of
{role, content}, rendered with the model's chat template) or a `prompt` column (plain text). Params:
`max_tokens`, `temperature` (0: greedy), `top_p`. Output: the generated text of each row.
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel

HF_ARTIFACT = "hf_model"  # the artifact key of the HF folder
DEFAULT_PARAMS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0}


class HFGenerator(PythonModel):
    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = context.artifacts[HF_ARTIFACT]
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()

    def predict(self, context, model_input, params=None):
        rows = model_input.to_dict("records") if hasattr(model_input, "to_dict") else list(model_input)
        params = {**DEFAULT_PARAMS, **(params or {})}
        return [self._generate(row, params) for row in rows]

    def _prompt_ids(self, row) -> list[int]:
        messages = row.get("messages")
        if hasattr(messages, "__len__") and len(messages) > 0:  # a missing cell may come as None or NaN
            chat = [{"role": m["role"], "content": m["content"]} for m in messages]
            rendered = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"each row needs `messages` (a chat) or `prompt` (text); got columns {sorted(row)}")
        return self.tokenizer(prompt)["input_ids"]

    def _generate(self, row, params) -> str:
        import torch

        ids = torch.tensor([self._prompt_ids(row)])
        sample = float(params["temperature"]) > 0
        extra = {"temperature": float(params["temperature"]), "top_p": float(params["top_p"])} if sample else {}
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(params["max_tokens"]),
                                      do_sample=sample, pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                                      **extra)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


mlflow.models.set_model(HFGenerator())
