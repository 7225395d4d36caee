"""A reward model: a sequence-classification model scoring (prompt, completion) pairs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from builtin_rewards._text import completion_text, prompt_text, without_surrogates


class RewardModel:
    """Scores each (prompt, completion) with ``AutoModelForSequenceClassification`` loaded from
    a local path (or a cached hub id; never downloaded), in batches, on the trainer's device
    (accelerate's current device) unless ``device`` says otherwise. The score is the logit of
    ``label`` (0 for the usual one-label reward model).

    Conversational pairs are formatted with the reward model's chat template when it has one;
    otherwise prompt and completion are joined with a newline.
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", protected_namespaces=())
        model_path: str = Field(description="Local directory of the reward model (and its tokenizer).")
        batch_size: int = Field(8, ge=1)
        max_length: int = Field(1024, ge=8, description="Longer inputs are truncated from the left.")
        device: str = Field("auto", description="'auto': the trainer's device (accelerate), or e.g. 'cpu', 'cuda:0'.")
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
        label: int = Field(0, ge=0, description="Which output logit is the reward.")
        scale: float = Field(1.0, description="Multiplies the logit.")

    def __init__(self, params: Params) -> None:
        self.params = params
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        p = self.params
        if p.device == "auto":
            from accelerate import PartialState

            device = PartialState().device
        else:
            device = torch.device(p.device)
        dtype = "auto" if p.dtype == "auto" else getattr(torch, p.dtype)
        tok = AutoTokenizer.from_pretrained(p.model_path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(p.model_path, dtype=dtype, local_files_only=True)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tok.pad_token_id
        tok.truncation_side = "left"  # keep the completion, drop the start of a long prompt
        self._model, self._tokenizer = model.to(device).eval(), tok

    def _text(self, prompt: Any, completion: Any) -> str:
        tok = self._tokenizer
        if isinstance(prompt, list) and getattr(tok, "chat_template", None):
            messages = list(prompt) + [{"role": "assistant", "content": completion_text(completion)}]
            return without_surrogates(tok.apply_chat_template(messages, tokenize=False))
        return without_surrogates(f"{prompt_text(prompt)}\n{completion_text(completion)}")

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        import torch

        if self._model is None:
            self._load()
        p = self.params
        texts = [self._text(pr, c) for pr, c in zip(prompts, completions)]
        scores: list[float] = []
        device = next(self._model.parameters()).device
        for start in range(0, len(texts), p.batch_size):
            batch = self._tokenizer(
                texts[start : start + p.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=p.max_length,
            ).to(device)
            with torch.inference_mode():
                logits = self._model(**batch).logits  # (b, num_labels)
            scores.extend((logits[:, p.label].float() * p.scale).tolist())
        return scores

    def close(self) -> None:
        self._model = self._tokenizer = None
