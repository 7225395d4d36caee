"""A scripted policy for tests: a generator whose completions are fixed text.

``ScriptedGenerator(reply)`` answers each prompt with ``reply(prompt_text)`` (a function of the
decoded prompt, so a test can script a whole conversation: "call the tool first, then answer"),
tokenized and followed by EOS. Its ``sampling_logps`` are a fixed value per token, so tests can
check where sampler log-probs end up. Register it as a generator (or pass it straight to an
environment's ``setup``) to run environments and the engine without sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from grpo_plugins.kinds import GenerationOutput, Generator

if TYPE_CHECKING:
    from torch import Tensor


class ScriptedGenerator(Generator):
    """Fixed completions: ``reply(prompt_text)`` + EOS, cut at ``max_completion_length``.

    Args:
        reply: the completion text for a decoded prompt (special tokens kept), or one fixed text.
        eos: end each completion with the tokenizer's EOS (False: the completion is truncated).
        logp: the sampling log-prob reported for every sampled token.
    """

    def __init__(self, reply: Callable[[str], str] | str = "", *, eos: bool = True, logp: float = -0.5) -> None:
        self.reply = reply if callable(reply) else (lambda _prompt, text=reply: text)
        self.eos, self.logp = eos, logp
        self.calls: list[list[list[int]]] = []  # every generate() call's prompt ids

    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        import torch

        self.calls.append([list(p) for p in prompt_ids])
        limit = self.sampling.max_completion_length
        rows, truncated = [], []
        for ids in prompt_ids:
            text = self.reply(self.tokenizer.decode(ids, skip_special_tokens=False))
            tokens = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if self.eos:
                tokens.append(int(self.tokenizer.eos_token_id))
            truncated.append(len(tokens) > limit or not self.eos)
            rows.append(tokens[:limit] or [int(self.tokenizer.pad_token_id)])
        width = max(len(r) for r in rows)
        pad = int(self.tokenizer.pad_token_id)
        ids_t: Tensor = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        return GenerationOutput(
            completion_ids=ids_t,
            completion_mask=mask,
            is_truncated=torch.tensor(truncated, dtype=torch.bool),
            sampling_logps=mask.float() * self.logp,
        )


def scripted_setup(generator: ScriptedGenerator, tokenizer: Any, max_completion_length: int = 64) -> ScriptedGenerator:
    """``generator`` set up with ``tokenizer`` and a budget (no model needed)."""
    from grpo_plugins.kinds import SamplingSettings

    generator.setup(None, tokenizer, SamplingSettings(max_completion_length=max_completion_length))
    return generator
