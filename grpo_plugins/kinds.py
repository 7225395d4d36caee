"""The component kinds and the small interface each one implements.

Every component has the same shape:

* an object registered under a name (a class, or for rewards also a plain function);
* optionally a pydantic model of its parameters, declared as the class attribute ``Params``;
* when a run uses it, the registry *builds* it: a class with ``Params`` is instantiated as
  ``cls(params)`` with the validated parameters, a class without as ``cls()``, and anything
  else (a function) is used as it is.

The base classes below (for the objective's kinds: :mod:`grpo_plugins.objective_kinds`, whose
names are importable from here too) document the interface of each kind; subclassing them is
convenient but not required (a class with the right methods is enough). :data:`KINDS`, at the end, names the
kinds and the hook that registers each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from grpo_plugins.objective_kinds import (
    ImportanceSampling,
    LossInputs,
    LossType,
    RewardScaling,
    RolloutCorrection,
    RowExtremum,
    clip_indicators,
    clipped_surrogate,
)

__all__ = [
    "KINDS",
    "Environment",
    "EnvironmentSettings",
    "Episodes",
    "GenerationOutput",
    "Generator",
    "GroupFilter",
    "ImportanceSampling",
    "LossInputs",
    "LossType",
    "RewardScaling",
    "RolloutCorrection",
    "RowExtremum",
    "SamplingSettings",
    "Task",
    "clip_indicators",
    "clipped_surrogate",
    "completion_text",
    "reward_interface",
    "tool_interface",
]

if TYPE_CHECKING:  # torch is imported lazily: `list` and `validate` must start in well under 1 s.
    from torch import Tensor

# --------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------


def reward_interface(
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]] | None = None,
    **columns: Any,
) -> list[float | None]:
    """The reward contract (TRL's): one float, or None for "not applicable", per completion.

    Called with keyword arguments only; a reward declares the ones it reads (or ``**kwargs``).
    ``completions`` are strings for string prompts and ``[{"role": "assistant", "content": ...}]``
    for conversational ones (:func:`completion_text` gives the text of either); every dataset
    column arrives as a keyword argument holding one value per completion. Plain functions,
    callable instances and ``async def`` all work.
    """
    raise NotImplementedError


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion as a reward receives it: the string itself, or the content of
    the last message of a conversational completion (``[{"role": "assistant", "content": ...}]``).
    """
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    content = completion[-1].get("content", "")
    return content if isinstance(content, str) else str(content)


# --------------------------------------------------------------------------------------------
# Dynamic sampling
# --------------------------------------------------------------------------------------------


class GroupFilter:
    """Which groups of a generation batch are trained on (kind ``group_filter``; DAPO's dynamic
    sampling).

    ``keep`` sees the gathered rewards of one generation round and returns, per group, whether
    to train on it. While fewer than ``unique_prompts`` groups are kept the engine generates
    another round of ``unique_prompts`` new prompts, at most ``max_refill_rounds`` times; then it
    trains on the kept groups (surplus ones are discarded, empty slots are masked out).

    * ``drops_groups``: False for a filter that never drops anything (``keep_all``); the engine
      then takes the plain path (no gathering of completions, no group-filter metrics).
    * optional method ``check_rewards(names: list[str]) -> None``: raise ValueError when the
      filter cannot work with a run whose rewards are ``names`` (``validate`` calls it, so a
      wrong reward name is reported before a model is loaded).
    """

    Params: ClassVar[type[BaseModel] | None] = None
    drops_groups: ClassVar[bool] = True

    def keep(self, rewards: Tensor, total: Tensor, names: list[str], num_generations: int) -> Tensor:
        """(N, K) rewards per reward function (NaN: not applicable), (N,) their weighted sum
        (NaN where no reward applies), the K reward names and G; groups are G consecutive rows
        -> (N/G,) bool, True for the groups to train on. Must not modify its inputs."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


@dataclass
class SamplingSettings:
    """The sampling parameters of a run, as the config names them."""

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    #: ``generation_kwargs``: more arguments for the backend's own sampling API (a backend that
    #: supports them sets ``accepts_generation_kwargs = True``).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationOutput:
    """What a generator returns for B prompts; T = longest completion in the batch."""

    completion_ids: Tensor  # (B, T) long, right-padded with the pad token
    completion_mask: Tensor  # (B, T) long, 1 for tokens up to and including EOS
    is_truncated: Tensor  # (B,) bool: no EOS within max_completion_length
    sampling_logps: Tensor | None = None  # (B, T) log-probs of the sampled tokens, or None


class Generator:
    """A generation backend (kind ``generator``).

    Lifecycle: built with its params, then ``setup`` once with the model being trained, then
    ``generate`` once per generation cycle and ``on_weights_updated`` after each optimizer step
    (a backend holding its own copy of the weights syncs them there).
    """

    Params: ClassVar[type[BaseModel] | None] = None
    #: True when it samples with the trained model itself, so no sampler/trainer mismatch
    #: correction is needed (``vllm_importance_sampling_correction: auto`` stays off).
    samples_from_policy: ClassVar[bool] = True
    #: True when it passes ``SamplingSettings.extra`` (``generation_kwargs``) to its sampler.
    accepts_generation_kwargs: ClassVar[bool] = False
    #: True when it generates from prompts whose ids carry image inputs
    #: (:class:`~grpo_plugins.multimodal.PromptIds`, a vision-language model's run).
    accepts_images: ClassVar[bool] = False
    #: The run's registry, set by the engine before ``setup``: a backend that builds another
    #: generator (a fallback) builds it from there, so ``disable_plugins`` applies to it too.
    registry: Any = None

    def setup(self, model: Any, tokenizer: Any, sampling: SamplingSettings) -> None:
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling

    def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
        raise NotImplementedError

    def generate_beside(self, prompt_ids: list[list[int]]) -> Callable[[], GenerationOutput] | None:
        """Ready a generation of ``prompt_ids`` that another thread runs while the training pass
        runs (``generate_ahead``), or None where this backend cannot. Called in the training
        thread, it does whatever must not run beside training (compiling, capturing graphs,
        advancing the seed); the returned call then only reads the weights, which do not change
        until it has returned. Default: None (the run then generates before training)."""
        return None

    def on_weights_updated(self, model: Any) -> None:
        """Called after each optimizer step."""

    def memory_advice(self, phase: str) -> list[str]:
        """This backend's settings that would lower peak device memory in ``phase``
        (``generation``, ``log-probs`` or ``training``), each naming its config key and current
        value; listed when the run runs out of device memory. Default: none."""
        return []

    @contextmanager
    def sampling_override(self, sampling: SamplingSettings) -> Iterator[None]:
        """Generate with ``sampling`` instead of the run's settings inside the block (evaluation's
        greedy pass uses ``top_k=1``). The default swaps ``self.sampling``; a backend that bakes
        the settings into state built in ``setup`` overrides it."""
        previous, self.sampling = self.sampling, sampling
        try:
            yield
        finally:
            self.sampling = previous


# --------------------------------------------------------------------------------------------
# Environments (rollouts) and tools
# --------------------------------------------------------------------------------------------


@dataclass
class EnvironmentSettings:
    """What an environment needs to know about the run.

    Attributes:
        max_completion_length: the most tokens the *model* may produce in one episode, over all
            of its turns (tokens the environment inserts do not count).
        pad_token_id: written after the end of each episode's tokens.
        eos_token_ids: the ids that end a model turn.
        chat_template_kwargs: the config's extra arguments of the chat template (e.g.
            ``enable_thinking``), for prompts and for whatever the environment renders.
    """

    max_completion_length: int = 256
    pad_token_id: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episodes:
    """What an environment returns for B prompts: every token after each prompt, and whose it is.

    T = the longest episode. ``completion_ids`` holds the model's turns *and* the tokens the
    environment put between them (tool results, chat-template tokens), in order; only the
    tokens of ``model_mask`` carry the loss and count against ``max_completion_length``.
    """

    completion_ids: Tensor  # (B, T) long, right-padded with the pad token
    completion_mask: Tensor  # (B, T) long, 1 for every token of the episode (attention)
    model_mask: Tensor  # (B, T) long, 1 where the model produced the token (the loss mask)
    is_truncated: Tensor  # (B,) bool: the model's budget ran out inside a turn (no EOS)
    sampling_logps: Tensor | None = None  # (B, T) sampler log-probs of model tokens, 0 elsewhere
    #: What the rewards receive as ``completions``, one per episode; None: the decoded text of
    #: the model's tokens (the single-turn behaviour).
    completions: list[Any] | None = None
    #: Extra dataset-like columns for the rewards, one value per episode (e.g. ``tool_calls``).
    info: dict[str, list[Any]] = field(default_factory=dict)
    #: Per-episode numbers logged as ``env/<name>`` (mean over the generation batch), e.g.
    #: ``turns``, ``tool_calls``, ``tool_errors``.
    stats: dict[str, list[float]] = field(default_factory=dict)


class Environment:
    """Drives one episode per prompt: the rollout itself (kind ``environment``).

    Lifecycle: built with its params, then ``setup`` once (the run's generator, tokenizer and
    :class:`EnvironmentSettings`), then ``encode_prompts`` and ``run`` once per generation cycle
    for this process's prompts. ``run`` samples with ``self.generator.generate(prompt_ids)`` --
    as often as it likes, re-prompting with grown sequences for further turns -- and returns
    :class:`Episodes`. The built-in ``single_turn`` (the default) calls the generator once.
    """

    Params: ClassVar[type[BaseModel] | None] = None
    #: The run's registry, set by the engine before ``setup`` (to look up tools and the like).
    registry: Any = None

    def setup(self, generator: Any, tokenizer: Any, settings: EnvironmentSettings) -> None:
        self.generator, self.tokenizer, self.settings = generator, tokenizer, settings

    def run_beside(self, prompts: list[Any], prompt_ids: list[list[int]], columns: dict[str, list[Any]]) -> Callable[[], Episodes] | None:
        """``run`` readied to go in another thread beside the training pass (``generate_ahead``;
        see :meth:`Generator.generate_beside`), or None where it cannot. Default: None."""
        return None

    def encode_prompts(self, prompts: list[Any], max_prompt_length: int | None, truncation: str) -> list[list[int]]:
        """The token ids of each prompt (chat messages through the chat template); the default
        is the core's :func:`grpo_plugins.prompt_encoding.encode_prompts`."""
        from grpo_plugins.prompt_encoding import encode_prompts

        return encode_prompts(
            self.tokenizer, prompts, max_prompt_length=max_prompt_length, truncation=truncation,  # type: ignore[arg-type]
            chat_template_kwargs=self.settings.chat_template_kwargs,
        )

    def run(self, prompts: list[Any], prompt_ids: list[list[int]], columns: dict[str, list[Any]]) -> Episodes:
        """One episode per prompt: ``prompts`` as in the dataset, ``prompt_ids`` their tokens,
        ``columns`` the other dataset columns (one value per prompt)."""
        raise NotImplementedError


def tool_interface(**arguments: Any) -> Any:
    """The tool contract (TRL's): a plain function with type hints and a Google-style docstring
    (``Args:`` describes each argument), called with the keyword arguments of the model's tool
    call. Its result is turned into text (``str``, or JSON for other values) as the tool
    message; an exception becomes the message ``Error: ...``.
    """
    raise NotImplementedError


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------


class Task:
    """A named dataset plus its default rewards (kind ``task``).

    ``load`` returns a ``datasets.Dataset`` with a ``prompt`` column (a string, or a list of chat
    messages) and any other columns the rewards read (they reach reward functions as keyword
    arguments). ``load_eval`` (optional) returns held-out prompts for ``grpo-plugins eval`` and
    evaluation during training, disjoint from ``load``'s. ``default_rewards`` are used when the config names no rewards; entries are
    written as in the config (``"name"`` or ``{"name": ..., "weight": ..., "params": ...}``).
    """

    Params: ClassVar[type[BaseModel] | None] = None
    default_rewards: ClassVar[list[str | dict[str, Any]]] = []

    def load(self, seed: int) -> Any:
        raise NotImplementedError

    def load_eval(self, seed: int) -> Any:
        """The task's held-out prompts for evaluation (same columns as ``load``), which share no
        prompt with ``load(seed)``; None (the default): the task has no held-out split."""
        return None


# --------------------------------------------------------------------------------------------
# The kinds
# --------------------------------------------------------------------------------------------

#: Each kind of component and the hook (in :mod:`grpo_plugins.hookspecs`) that registers it, in
#: the order ``grpo-plugins list`` shows them.
KINDS: dict[str, str] = {
    "reward": "register_rewards",
    "loss_type": "register_loss_types",
    "importance_sampling": "register_importance_sampling_levels",
    "reward_scaling": "register_reward_scalings",
    "rollout_correction": "register_rollout_corrections",
    "generator": "register_generators",
    "group_filter": "register_group_filters",
    "environment": "register_environments",
    "tool": "register_tools",
    "task": "register_tasks",
}
