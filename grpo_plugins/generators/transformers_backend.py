"""The ``transformers`` generation backend: batched ``model.generate`` with the trained model.

Prompts whose ids carry image inputs (a vision-language model's run) pass them to ``generate``.
Sampling uses the run's temperature, top_k, top_p, min_p and repetition_penalty. The sampling
warpers are passed to ``generate`` explicitly (in transformers' own order: repetition penalty,
temperature, top-k, top-p, min-p), followed by a recorder that keeps, step by step, the
log-probability of the token actually sampled under that processed distribution. So
``sampling_logps`` costs one (B, vocab) tensor, not one per step.

torch and transformers are imported inside functions: this module is imported when the registry
loads its plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from grpo_plugins.generators.common import cut_at_eos, eos_token_ids, seeded_call, unwrap_model
from grpo_plugins.kinds import GenerationOutput, Generator, SamplingSettings
from grpo_plugins.multimodal import collate, multimodal_of, placeholder_token_ids

if TYPE_CHECKING:
    import torch
    from torch import Tensor


class TransformersGeneratorParams(BaseModel):
    """Parameters of the ``transformers`` generator."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int | None = Field(
        None, ge=1, description="Prompts per generate() call; None: the whole generation batch at once."
    )


def finish_completions(
    completions: Tensor, eos_ids: list[int], pad_token_id: int, max_completion_length: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Cut raw sampled tokens (B, T') at ``max_completion_length`` and the first EOS
    (:func:`~grpo_plugins.generators.common.cut_at_eos`)."""
    import torch

    completions = completions[:, :max_completion_length]
    is_eos = torch.isin(completions, torch.tensor(eos_ids, device=completions.device))  # (B, T')
    return cut_at_eos(completions, is_eos, pad_token_id)


def _sampled_logps_recorder() -> Any:
    """A logits processor, placed last, that records log p(sampled token) under the processed
    distribution: at step t+1 it reads the token sampled at step t from ``input_ids``."""
    import torch
    from transformers import LogitsProcessor

    class SampledLogps(LogitsProcessor):
        def __init__(self) -> None:
            self.previous: Tensor | None = None  # (B, V) log-probs of the last step
            self.steps: list[Tensor] = []  # each (B,)

        def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
            self._gather(input_ids[:, -1])
            self.previous = torch.log_softmax(scores.float(), dim=-1)
            return scores

        def _gather(self, tokens: Tensor) -> None:
            if self.previous is not None:
                self.steps.append(self.previous.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
                self.previous = None

        def result(self, sequences: Tensor) -> Tensor:
            self._gather(sequences[:, -1])
            if not self.steps:
                return torch.zeros(sequences.shape[0], 0, device=sequences.device)
            return torch.stack(self.steps, dim=1)  # (B, T')

    return SampledLogps()


def sampling_processors(sampling: SamplingSettings) -> list[Any]:
    """The warpers of ``sampling`` in transformers' order (repetition penalty is added by
    ``generate`` itself from the generation config, before these)."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    processors: list[Any] = []
    if sampling.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        processors.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=sampling.top_p))
    if sampling.min_p:
        processors.append(MinPLogitsWarper(min_p=sampling.min_p))
    return processors


class TransformersGenerator(Generator):
    """Sample completions with ``model.generate`` from the model being trained.

    Left-pads the prompts, samples up to ``max_completion_length`` new tokens, cuts each row after
    its first EOS and returns the log-prob of every sampled token under the processed sampling
    distribution. Runs in eval mode with the KV cache (also under gradient checkpointing) and
    restores the train mode afterwards. Seeded from ``sampling.seed`` plus a per-call counter
    (``state_dict`` holds the counter for resuming).
    """

    Params = TransformersGeneratorParams
    accepts_generation_kwargs = True
    accepts_images = True
    samples_from_policy = True

    def __init__(self, params: TransformersGeneratorParams | None = None) -> None:
        self.params = params or TransformersGeneratorParams()
        self.calls = 0

    def setup(self, model: Any, tokenizer: Any, sampling: SamplingSettings) -> None:
        super().setup(model, tokenizer, sampling)
        if tokenizer.pad_token_id is None:
            from grpo_plugins.models import prepare_tokenizer

            prepare_tokenizer(tokenizer)

    # -- resuming --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = int(state.get("calls", 0))

    # -- generation ------------------------------------------------------------------------------

    def generation_config(self, model: Any) -> Any:
        """The GenerationConfig of a call: sampling, no built-in warpers (passed explicitly)."""
        from transformers import GenerationConfig

        # Every warper is set to its neutral value explicitly: left unset, generate() would fill
        # them from the model's own generation_config (or global defaults such as top_k=50) and
        # apply them after our processors, so tokens would be sampled from a distribution the
        # loss and the recorded sampling log-probs know nothing about.
        extra = dict(self.sampling.extra)  # generation_kwargs (the sampling ones were moved to their keys)
        # A vision model's image tokens are never sampled, on top of any the user suppresses.
        suppress = [*(extra.pop("suppress_tokens", None) or [])]
        suppress += [t for t in placeholder_token_ids(model.config) or [] if t not in suppress]
        return GenerationConfig(
            do_sample=True,
            num_beams=1,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            max_new_tokens=self.sampling.max_completion_length,
            repetition_penalty=self.sampling.repetition_penalty,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=eos_token_ids(model, self.tokenizer),
            use_cache=True,
            return_dict_in_generate=True,
            suppress_tokens=suppress or None,
            **extra,
        )

    def _generate_batch(self, model: Any, prompt_ids: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Raw sampled tokens (B, T') and their sampling log-probs (B, T') for one batch."""
        from transformers import LogitsProcessorList

        from grpo_plugins.data import left_pad

        device = next(model.parameters()).device
        ids, mask = left_pad(prompt_ids, self.tokenizer.pad_token_id, device=device)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        images = collate([multimodal_of(p) for p in prompt_ids], ids, ids.shape[1], dtype)  # {} for text
        recorder = _sampled_logps_recorder()
        processors = LogitsProcessorList([*sampling_processors(self.sampling), recorder])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=self.generation_config(model),
            logits_processor=processors,
            # FSDP: the engine gathers the full weights around generation (sharding.gathered),
            # so each process decodes alone, without transformers' per-token synchronisation.
            synced_gpus=False,
            **images,
        )
        sequences = out.sequences if hasattr(out, "sequences") else out  # (B, P + T')
        return sequences[:, ids.shape[1] :], recorder.result(sequences)

    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        import torch

        model = unwrap_model(self.model)
        was_training = model.training
        call, self.calls = self.calls, self.calls + 1
        device = next(model.parameters()).device
        batch = self.params.batch_size or max(len(prompt_ids), 1)
        pieces: list[tuple[Tensor, Tensor]] = []
        model.eval()  # also turns gradient checkpointing off, so the KV cache is used
        try:
            with seeded_call(self.sampling.seed, call, device), torch.no_grad():
                for start in range(0, len(prompt_ids), batch):
                    pieces.append(self._generate_batch(model, prompt_ids[start : start + batch]))
        finally:
            model.train(was_training)
        return self._assemble(pieces, model)

    def _assemble(self, pieces: list[tuple[Tensor, Tensor]], model: Any) -> GenerationOutput:
        import torch

        pad = self.tokenizer.pad_token_id
        width = max((tokens.shape[1] for tokens, _ in pieces), default=0)
        tokens = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad) for t, _ in pieces])
        logps = torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for _, lp in pieces])
        ids, mask, truncated, _ = finish_completions(
            tokens, eos_token_ids(model, self.tokenizer), pad, self.sampling.max_completion_length
        )
        T = ids.shape[1]
        logps = torch.nn.functional.pad(logps, (0, max(T - logps.shape[1], 0)))[:, :T]
        logps = logps.masked_fill(mask == 0, 0.0)  # (B, T)
        return GenerationOutput(completion_ids=ids, completion_mask=mask, is_truncated=truncated, sampling_logps=logps)
