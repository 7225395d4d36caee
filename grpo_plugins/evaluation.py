"""Evaluation on held-out prompts: ``grpo-plugins eval`` and evaluation during training.

For every eval prompt the run's environment runs ``num_generations_eval`` episodes with the
run's sampling settings, plus one greedy episode (``top_k=1``), and the run's rewards score them
-- the same environment, generator and scorer as training: a tool-calling run evaluates with its
tools prompt and multi-turn episodes. Reported per reward: the mean over
the samples, the greedy completion's mean score (greedy accuracy for a 0/1 reward) and, for
rewards that scored only 0 and 1, pass@1 and pass@k (k = ``num_generations_eval``, the unbiased
estimator :func:`pass_at_k`); over all rewards: the weighted reward and mean completion lengths.

Evaluation does not touch the training's random streams: it samples under its own seed (the
config's ``seed`` plus the process index, so every evaluation of a run sees the same random
numbers) inside a saved and restored RNG state, and it restores the generator's own state (its
call counter) afterwards. An interrupted and resumed run therefore trains and evaluates exactly as
an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_plugins.checkpoint import STATE_FILE, CheckpointError, capture_rng, latest_checkpoint, restore_rng
from grpo_plugins.config import GRPOConfig
from grpo_plugins.console import quiet_libraries
from grpo_plugins.eval_results import EvalResult, RewardSummary, pass_at_k, summarise
from grpo_plugins.scoring import RewardFailed, raise_if_any_failed, score_episodes, with_info

if TYPE_CHECKING:
    from torch import Tensor

    from grpo_plugins.registry import Registry

# The results (eval_results.py) are read through this module too.
__all__ = ["EvalResult", "Evaluator", "RewardSummary", "evaluate", "pass_at_k", "summarise"]


# -- running ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Run the block under ``seed`` (python, numpy, torch and every CUDA device) and put every
    RNG state back afterwards, as if the block had never drawn a random number."""
    import numpy as np
    import torch

    saved = capture_rng()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        yield
    finally:
        restore_rng(saved)


@contextlib.contextmanager
def generator_state_kept(generator: Any) -> Iterator[None]:
    """Restore the generator's own state (e.g. the call counter its seeds derive from) after the
    block, so that evaluating does not change what training samples next."""
    state = copy.deepcopy(generator.state_dict()) if hasattr(generator, "state_dict") else None
    try:
        yield
    finally:
        if state is not None and hasattr(generator, "load_state_dict"):
            generator.load_state_dict(state)


def sampling_override(generator: Any, sampling: Any) -> contextlib.AbstractContextManager[None]:
    """The generator's ``sampling_override`` (see :class:`~grpo_plugins.kinds.Generator`), or the
    default (swap its ``sampling``) for a generator that does not subclass it."""
    from grpo_plugins.kinds import Generator

    override = getattr(generator, "sampling_override", None)
    return override(sampling) if override is not None else Generator.sampling_override(generator, sampling)


def greedy_settings(config: GRPOConfig) -> Any:
    """The run's sampling settings made greedy: ``top_k=1`` keeps only the most likely token (the
    run's repetition penalty and ``generation_kwargs`` still apply), so every backend that
    supports top-k decodes greedily."""
    from grpo_plugins.kinds import SamplingSettings

    return SamplingSettings(
        max_completion_length=config.max_completion_length,
        temperature=1.0,
        top_p=1.0,
        top_k=1,
        min_p=None,
        repetition_penalty=config.repetition_penalty,
        seed=None,
        extra=dict(config.generation_kwargs or {}),
    )


class Evaluator:
    """Evaluates the model behind ``environment`` on the prompts of ``dataset``.

    Args:
        config: the run config (``num_generations_eval``, ``per_device_eval_batch_size``, the
            sampling settings, ``seed``, ``max_prompt_length``).
        environment: a set-up environment (the training's own during training); its generator
            samples, its tokenizer decodes.
        rewards: a :class:`~grpo_plugins.rewards.RewardRunner`.
        dataset: the eval prompts (a ``datasets.Dataset`` with a ``prompt`` column; other columns
            reach the rewards as keyword arguments).
        accelerator: the run's accelerator when several processes evaluate together (each takes
            every ``num_processes``-th prompt); None: one process.
    """

    def __init__(self, config: GRPOConfig, environment: Any, rewards: Any, dataset: Any, accelerator: Any = None) -> None:
        self.config, self.environment, self.rewards = config, environment, rewards
        self.generator, self.tokenizer = environment.generator, environment.tokenizer
        self.accelerator = accelerator
        self.rank = accelerator.process_index if accelerator is not None else 0
        self.world = accelerator.num_processes if accelerator is not None else 1
        self.n = config.resolved_num_generations_eval
        self.rows = [dataset[i] for i in range(len(dataset))]
        self.columns = [c for c in dataset.column_names if c != "prompt"]
        self.prompt_ids = environment.encode_prompts(
            [row["prompt"] for row in self.rows], config.max_prompt_length, config.prompt_truncation
        )

    def run(self, step: int = 0, model: str = "", progress: Callable[[int, int], None] | None = None) -> EvalResult:
        """Evaluate now (``step``: the optimizer step, passed to rewards as
        ``trainer_state.global_step``; ``model``: a label for the result; ``progress(done,
        total)`` is called after each generate call).

        Raises:
            RewardFailed: a reward failed (with ``on_error: raise``) on some process; its
                ``error`` is the reward's error on that process.
        """
        import torch

        from grpo_plugins.rewards import RewardError

        t0 = time.perf_counter()
        P = len(self.rows)
        per_process = math.ceil(P / self.world)
        share = list(range(self.rank, P, self.world))
        # Every process makes the same generate calls (FSDP gathers weights collectively): pad
        # the shorter shares with a repeated prompt whose results are dropped.
        padded = share + [share[-1] if share else 0] * (per_process - len(share))
        error: Exception | None = None
        sampled = greedy = None
        calls = [math.ceil(len(padded) / self._prompts_per_call(n)) for n in (self.n, 1)]
        self._progress = _Counter(sum(calls), progress)
        with isolated_rng(self.config.seed + self.rank), generator_state_kept(self.generator), torch.no_grad():
            try:
                sampled = self._generate(padded, self.n, step)
                with sampling_override(self.generator, greedy_settings(self.config)):
                    greedy = self._generate(padded, 1, step)
            except RewardError as exc:  # raised below on every process
                error = exc
        raise_if_any_failed(self.accelerator, error, " while evaluating")
        assert sampled is not None and greedy is not None
        local = [
            (i, *(t[j].tolist() for t in sampled), *(t[j].tolist() for t in greedy))
            for j, i in enumerate(padded[: len(share)])
        ]
        if self.world > 1:
            from accelerate.utils import gather_object

            local = gather_object(local)
        local.sort(key=lambda item: item[0])
        tensors = [torch.tensor([item[f] for item in local]) for f in range(1, 7)]
        K = len(self.rewards.names)
        result = summarise(
            tensors[0].reshape(P, self.n, K), tensors[1].reshape(P, self.n), tensors[2].reshape(P, self.n).bool(),
            tensors[3].reshape(P, K), tensors[4].reshape(P), self.rewards.names, self.rewards.weights,
        )
        result.seconds = time.perf_counter() - t0
        result.model = model
        return result

    def _generate(self, indices: list[int], n: int, step: int) -> tuple[Tensor, Tensor, Tensor]:
        """n episodes of each prompt in ``indices``, scored: ((I, n, K) rewards, (I, n) lengths in
        model tokens, (I, n) truncated). Calls hold whole prompts, about
        per_device_eval_batch_size episodes each."""
        import torch

        per_call = self._prompts_per_call(n)
        rewards, lengths, truncated = [], [], []
        for start in range(0, len(indices), per_call):
            chunk = [i for i in indices[start : start + per_call] for _ in range(n)]
            prompts = [self.rows[i]["prompt"] for i in chunk]
            columns = {c: [self.rows[i][c] for i in chunk] for c in self.columns}
            episodes = self.environment.run(prompts, [list(self.prompt_ids[i]) for i in chunk], columns)
            scores, _ = score_episodes(
                self.tokenizer, self.rewards, prompts, episodes.completion_ids, episodes.model_mask,
                with_info(columns, episodes.info), step, episodes.completions,
            )
            rewards.append(scores.float().cpu())
            lengths.append(episodes.model_mask.long().sum(1).cpu())  # (B,)
            truncated.append(episodes.is_truncated.bool().cpu())
            self._progress.advance()
        K = len(self.rewards.names)
        I = len(indices)
        return (
            torch.cat(rewards).reshape(I, n, K) if rewards else torch.zeros(0, n, K),
            torch.cat(lengths).reshape(I, n) if lengths else torch.zeros(0, n),
            torch.cat(truncated).reshape(I, n) if truncated else torch.zeros(0, n, dtype=torch.bool),
        )

    def _prompts_per_call(self, n: int) -> int:
        return max(1, self.config.per_device_eval_batch_size // n)


class _Counter:
    def __init__(self, total: int, callback: Callable[[int, int], None] | None) -> None:
        self.done, self.total, self.callback = 0, total, callback

    def advance(self) -> None:
        self.done += 1
        if self.callback is not None:
            self.callback(self.done, self.total)


# -- grpo-plugins eval -------------------------------------------------------------------------------


def resolve_eval_model(checkpoint: str | Path | None, base: bool, output_dir: str | Path) -> tuple[Path | None, str]:
    """The model directory to evaluate and a label for it.

    ``base``: None (the config's model, untrained). ``checkpoint``: a checkpoint directory, a
    run's output directory (its newest checkpoint), or a model directory (``config.json`` or a
    LoRA ``adapter_config.json``). Neither: the newest checkpoint of ``output_dir``.

    Raises:
        CheckpointError: with what to do instead.
    """
    if base:
        return None, "base"
    if checkpoint is None:
        found = latest_checkpoint(output_dir)
        if found is None:
            raise CheckpointError(
                f"no checkpoint in {Path(output_dir) / 'checkpoints'} (the config's output_dir); train first, "
                "name one with --checkpoint PATH, or evaluate the untrained model with --base"
            )
        return found / "model", str(found)
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise CheckpointError(f"--checkpoint '{path}' does not exist")
    if (path / STATE_FILE).is_file():
        return path / "model", str(path)
    found = latest_checkpoint(path)
    if found is not None:
        return found / "model", str(found)
    if (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        return path, str(path)
    raise CheckpointError(
        f"--checkpoint '{path}' is not a checkpoint (no {STATE_FILE}), a run directory with checkpoints, "
        "or a model directory (config.json or adapter_config.json)"
    )


def load_eval_model(config: GRPOConfig, model_dir: Path | None, device: Any) -> tuple[Any, Any]:
    """The model and tokenizer to evaluate: the config's model (``model_dir`` None), with a LoRA
    adapter directory applied, or a full model directory."""
    from grpo_plugins import models

    dtype = config.dtype
    if model_dir is not None and not (model_dir / "adapter_config.json").is_file():
        model, tokenizer = models.load_model(str(model_dir), dtype=dtype, device=device, seed=config.seed)
        return model.eval(), _text_tokenizer(tokenizer)
    model, tokenizer = models.load_model(config.model, dtype=dtype, device=device, seed=config.seed)
    tokenizer = _text_tokenizer(tokenizer)
    if model_dir is not None:
        from peft import PeftModel

        try:
            with warnings.catch_warnings():  # peft still calls the renamed is_gradient_checkpointing
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                model = PeftModel.from_pretrained(model, str(model_dir))
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"the LoRA adapter in {model_dir} does not fit the config's model ({config.model}): {exc}"
            ) from None
        model.to(device)
    return model.eval(), tokenizer


def _text_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer of a text model; a vision-language model's processor is refused."""
    from grpo_plugins.errors import GRPOPluginsError
    from grpo_plugins.vision_models import is_processor

    if is_processor(tokenizer):
        raise GRPOPluginsError("evaluating a vision-language model is not supported yet; evaluate a text model")
    return tokenizer


@quiet_libraries()
def evaluate(
    config: GRPOConfig,
    *,
    checkpoint: str | Path | None = None,
    base: bool = False,
    registry: Registry | None = None,
    eval_dataset: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Evaluate a checkpoint (or the untrained model with ``base``) on the config's eval prompts
    (the ``grpo-plugins eval`` command); see :func:`resolve_eval_model` for ``checkpoint``."""
    import torch

    from grpo_plugins.data import load_eval_prompts
    from grpo_plugins.episodes import build_environment
    from grpo_plugins.generators import build_generator
    from grpo_plugins.registry import registry_for
    from grpo_plugins.rewards import reward_runner

    registry = registry if registry is not None else registry_for(config.disable_plugins)
    model_dir, label = resolve_eval_model(checkpoint, base, config.output_dir)
    step = _checkpoint_step(model_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_eval_model(config, model_dir, device)
    dataset = load_eval_prompts(config, registry, tokenizer, eval_dataset)
    generator = build_generator(config, registry, model, tokenizer, device)
    environment = build_environment(config, registry, generator, tokenizer)
    rewards = reward_runner(config, registry)
    try:
        return Evaluator(config, environment, rewards, dataset).run(step=step, model=label, progress=progress)
    except RewardFailed as failed:
        raise failed.error from None
    finally:
        rewards.close()
        for part in (environment, generator):  # a tool environment's threads; vLLM's engine
            close = getattr(part, "close", None)
            if close is not None:
                close()


def _checkpoint_step(model_dir: Path | None) -> int:
    """The optimizer step of the checkpoint holding ``model_dir`` (0 for anything else)."""
    if model_dir is None:
        return 0
    try:
        state = json.loads((model_dir.parent / STATE_FILE).read_text())
    except (OSError, ValueError):
        return 0
    return int(state.get("global_step", 0)) if isinstance(state, Mapping) else 0
