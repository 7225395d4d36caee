"""Episodes: what the ``environment`` kind returns, and the machinery of multi-turn rollouts.

* :func:`single_turn` wraps one :class:`~grpo_plugins.kinds.GenerationOutput` as
  :class:`~grpo_plugins.kinds.Episodes` (the built-in ``single_turn`` environment is that).
* :class:`TurnBasedEnvironment` drives a generation batch turn by turn with any generator: it
  samples one turn for every unfinished episode in one ``generate`` call, asks the subclass's
  :meth:`~TurnBasedEnvironment.respond` what the environment answers (tool results, a user's
  reply), appends the answer's tokens (rendered with the chat template) and re-prompts with the
  grown sequences. The model's tokens, and only those, end up in ``model_mask``; they are kept
  exactly as sampled (never re-tokenized), so the log-probs of the loss are computed on the very
  tokens that were sampled.

torch is imported inside functions: the registry imports environment plugins at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_plugins.errors import TrainingError
from grpo_plugins.kinds import Environment, Episodes

if TYPE_CHECKING:
    from grpo_plugins.kinds import GenerationOutput

#: Stands for an assistant turn's content when the chat template renders what follows it.
_PLACEHOLDER = "GRPO_PLUGINS_TURN_PLACEHOLDER"


def single_turn(out: GenerationOutput) -> Episodes:
    """One generated completion per prompt as episodes: every token is the model's."""
    mask = out.completion_mask.long()
    return Episodes(
        completion_ids=out.completion_ids,
        completion_mask=mask,
        model_mask=mask,
        is_truncated=out.is_truncated.bool(),
        sampling_logps=out.sampling_logps,
    )


@dataclass
class Episode:
    """One episode in progress, as :meth:`TurnBasedEnvironment.respond` sees it.

    Attributes:
        prompt: the prompt as in the dataset (a string or chat messages).
        row: the other dataset columns of its row.
        messages: the conversation after the prompt so far: ``{"role": "assistant", "content":
            text}`` per model turn and the environment's messages between them.
        turns: model turns so far.
        model_tokens: tokens the model has produced so far (bounded by max_completion_length).
        info: columns for the rewards (one value per episode; every episode must set the same keys).
        stats: numbers logged as ``env/<name>`` (mean over the batch; every episode the same keys).
        state: free for the environment's own use.
    """

    prompt: Any
    row: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    model_tokens: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    # (token ids, produced by the model, sampling log-probs or None) in order
    pieces: list[tuple[list[int], bool, list[float] | None]] = field(default_factory=list)
    truncated: bool = False
    done: bool = False


def chat_reply_ids(tokenizer: Any, reply: list[dict[str, Any]], turn_ids: list[int], eos_ids: list[int], **template_kwargs: Any) -> list[int]:
    """The tokens the chat template puts after an assistant turn when ``reply`` follows it,
    through the start of the next assistant turn (``add_generation_prompt``).

    The template is rendered once with a placeholder assistant turn; what follows the
    placeholder is tokenized. An end-of-turn token the model produced itself (the last of
    ``turn_ids``, when the rendered text starts with it too) is not repeated.
    """
    messages = [{"role": "user", "content": "."}, {"role": "assistant", "content": _PLACEHOLDER}, *reply]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception as exc:  # jinja raises its own errors, e.g. for a role the template refuses
        roles = sorted({m.get("role", "?") for m in reply})
        raise TrainingError(
            f"the tokenizer's chat template cannot render the environment's messages (roles {roles}): {exc}; "
            "use a model whose template supports them, or plain-text prompts"
        ) from exc
    at = text.rfind(_PLACEHOLDER)
    if at < 0:
        raise TrainingError("the tokenizer's chat template drops assistant messages; it cannot be used for multi-turn episodes")
    ids = list(tokenizer(text[at + len(_PLACEHOLDER) :], add_special_tokens=False)["input_ids"])
    if turn_ids and ids and turn_ids[-1] in eos_ids and ids[0] == turn_ids[-1]:
        ids = ids[1:]
    return ids


class TurnBasedEnvironment(Environment):
    """A multi-turn environment: subclasses implement :meth:`respond` (and optionally
    :meth:`start`, :meth:`render_text`); :meth:`run` does the rest.

    Each round samples one turn for every unfinished episode with one ``generate`` call (the
    generator's own ``max_completion_length`` per call; a turn is then cut to what is left of
    the episode's budget). An episode ends when :meth:`respond` returns None, after
    ``max_turns`` model turns, when its budget of ``max_completion_length`` model tokens is
    used up, or when a turn ends without EOS (``is_truncated``).
    """

    #: The most model turns per episode; None: only the token budget bounds them.
    max_turns: int | None = None

    # -- what a subclass implements ---------------------------------------------------------

    def start(self, episode: Episode) -> None:
        """Called once per episode before its first turn (e.g. to set ``episode.stats`` keys)."""

    def respond(self, episode: Episode, turn: str) -> list[dict[str, Any]] | None:
        """The environment's messages after the model's ``turn`` (its text, special tokens
        removed; also the last of ``episode.messages``), or None to end the episode."""
        raise NotImplementedError

    def respond_batch(self, episodes: list[Episode], turns: list[str]) -> list[list[dict[str, Any]] | None]:
        """:meth:`respond` for the episodes of one round (override to answer them concurrently)."""
        return [self.respond(e, t) for e, t in zip(episodes, turns)]

    def render_text(self, reply: list[dict[str, Any]]) -> str:
        """How the environment's messages read after a turn when prompts are plain text (no
        chat template): each as ``<tool_response>...</tool_response>``-style tags by role."""
        parts = []
        for message in reply:
            tag = "tool_response" if message.get("role") == "tool" else str(message.get("role", "user"))
            parts.append(f"\n<{tag}>\n{message.get('content', '')}\n</{tag}>\n")
        return "".join(parts)

    def chat_template_kwargs(self) -> dict[str, Any]:
        """Extra arguments of the chat template (e.g. ``tools=``), for prompts and replies; the
        config's ``chat_template_kwargs`` are added to them."""
        return {}

    def _template_kwargs(self) -> dict[str, Any]:
        return {**self.settings.chat_template_kwargs, **self.chat_template_kwargs()}

    # -- the driver ---------------------------------------------------------------------------

    def encode_prompts(self, prompts: list[Any], max_prompt_length: int | None, truncation: str) -> list[list[int]]:
        from grpo_plugins.data import encode_prompts

        return encode_prompts(
            self.tokenizer, prompts, max_prompt_length=max_prompt_length, truncation=truncation,  # type: ignore[arg-type]
            chat_template_kwargs=self._template_kwargs(),
        )

    def reply_ids(self, episode: Episode, reply: list[dict[str, Any]], turn_ids: list[int]) -> list[int]:
        """The tokens of the environment's ``reply`` after a turn of ``turn_ids``."""
        if isinstance(episode.prompt, str):
            return list(self.tokenizer(self.render_text(reply), add_special_tokens=False)["input_ids"])
        return chat_reply_ids(self.tokenizer, reply, turn_ids, self.settings.eos_token_ids, **self._template_kwargs())

    def run(self, prompts: list[Any], prompt_ids: list[list[int]], columns: dict[str, list[Any]]) -> Episodes:
        episodes = [
            Episode(prompt=p, row={k: v[i] for k, v in columns.items()}) for i, p in enumerate(prompts)
        ]
        for episode in episodes:
            self.start(episode)
        sequences = [list(p) for p in prompt_ids]
        budget = self.settings.max_completion_length
        while True:
            active = [i for i, e in enumerate(episodes) if not e.done]
            if not active:
                break
            out = self.generator.generate([sequences[i] for i in active])
            lengths = out.completion_mask.sum(1).tolist()
            responders: list[int] = []
            for j, i in enumerate(active):
                episode = episodes[i]
                n = int(lengths[j])
                ids = out.completion_ids[j, :n].tolist()
                logps = out.sampling_logps[j, :n].tolist() if out.sampling_logps is not None else None
                left = budget - episode.model_tokens
                cut = n > left or bool(out.is_truncated[j])
                ids, logps = ids[:left], (logps[:left] if logps is not None else None)
                episode.pieces.append((ids, True, logps))
                episode.model_tokens += len(ids)
                episode.turns += 1
                sequences[i] += ids
                episode.messages.append({"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)})
                if cut:
                    episode.truncated = episode.done = True
                elif episode.model_tokens >= budget or (self.max_turns is not None and episode.turns >= self.max_turns):
                    episode.done = True
                else:
                    responders.append(i)
            if not responders:
                continue
            replies = self.respond_batch(
                [episodes[i] for i in responders], [episodes[i].messages[-1]["content"] for i in responders]
            )
            for i, reply in zip(responders, replies):
                episode = episodes[i]
                if reply is None:
                    episode.done = True
                    continue
                reply = list(reply)
                episode.messages.extend(reply)
                ids = self.reply_ids(episode, reply, episode.pieces[-1][0])
                episode.pieces.append((ids, False, None))
                sequences[i] += ids
        return self.assemble(episodes)

    def assemble(self, episodes: list[Episode]) -> Episodes:
        """The padded tensors of finished episodes (sampling log-probs when every model turn
        has them)."""
        import torch

        B = len(episodes)
        T = max(1, max((sum(len(ids) for ids, _, _ in e.pieces) for e in episodes), default=1))
        pad = self.settings.pad_token_id
        ids = torch.full((B, T), pad, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.long)
        model = torch.zeros(B, T, dtype=torch.long)
        have_logps = all(lp is not None for e in episodes for _, m, lp in e.pieces if m)
        logps = torch.zeros(B, T) if have_logps else None
        for b, episode in enumerate(episodes):
            at = 0
            for piece, by_model, piece_logps in episode.pieces:
                n = len(piece)
                ids[b, at : at + n] = torch.tensor(piece, dtype=torch.long)
                mask[b, at : at + n] = 1
                if by_model:
                    model[b, at : at + n] = 1
                    if logps is not None and n:
                        logps[b, at : at + n] = torch.tensor(piece_logps, dtype=torch.float32)
                at += n
        stats_keys = [set(e.stats) for e in episodes]
        info_keys = [set(e.info) for e in episodes]
        if any(k != stats_keys[0] for k in stats_keys) or any(k != info_keys[0] for k in info_keys):
            raise TrainingError(
                f"environment '{type(self).__name__}': every episode must set the same info and stats keys"
            )
        stats = {"turns": [float(e.turns) for e in episodes]}
        for key in sorted(stats_keys[0]) if episodes else []:
            stats[key] = [float(e.stats[key]) for e in episodes]
        info = {key: [e.info[key] for e in episodes] for key in (sorted(info_keys[0]) if episodes else [])}
        conversational = [not isinstance(e.prompt, str) for e in episodes]
        completions: list[Any] = [
            list(e.messages) if chat else self.tokenizer.decode(ids[b, : int(mask[b].sum())].tolist(), skip_special_tokens=True)
            for b, (e, chat) in enumerate(zip(episodes, conversational))
        ]
        return Episodes(
            completion_ids=ids,
            completion_mask=mask,
            model_mask=model,
            is_truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool),
            sampling_logps=logps,
            completions=completions,
            info=info,
            stats=stats,
        )


def build_environment(config: Any, registry: Any, generator: Any, tokenizer: Any, environment: Any = None) -> Any:
    """The run's environment (``config.environment``, or an already built ``environment``),
    set up with the run's generator, tokenizer and token budget."""
    from grpo_plugins.config import component_ref
    from grpo_plugins.generators.common import eos_token_ids
    from grpo_plugins.kinds import EnvironmentSettings

    if environment is None:
        ref = component_ref(config.environment)
        assert ref is not None
        environment = registry.build("environment", ref.name, ref.params)
    if getattr(environment, "registry", None) is None:
        environment.registry = registry
    environment.setup(
        generator,
        tokenizer,
        EnvironmentSettings(
            max_completion_length=config.max_completion_length,
            pad_token_id=int(tokenizer.pad_token_id),
            eos_token_ids=eos_token_ids(getattr(generator, "model", None), tokenizer),
            chat_template_kwargs=dict(config.chat_template_kwargs or {}),
        ),
    )
    return environment
