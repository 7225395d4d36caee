"""Saving a run and resuming it exactly: what the engine hands to and gets from a checkpoint.

:func:`resume_point` finds the checkpoint to continue from before the model loads (or refuses a
fresh run over an earlier one); :func:`save_run` writes the run's parts and its position;
:func:`resume_run` puts both back -- weights, optimizer, scheduler, scaler, master weights, the
reference, the entropy control, the generator's state and this process's RNG streams -- and
returns the position to continue from. The files themselves are ``checkpoint.py``'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_plugins.checkpoint import (
    capture_rng, load_ahead, load_checkpoint, refuse_fresh_run_over, resolve_resume, restore_rng, save_checkpoint,
)
from grpo_plugins.rollout_batches import Rollout

if TYPE_CHECKING:
    from grpo_plugins.config import GRPOConfig
    from grpo_plugins.run_parts import RunParts

logger = logging.getLogger(__name__)

__all__ = ["Position", "resume_point", "resume_run", "save_run"]


@dataclass(frozen=True)
class Position:
    """Where a run stands: what a checkpoint records besides the parts' state.

    Attributes:
        global_step: optimizer steps done.
        num_tokens: prompt and completion tokens generated so far (all processes).
        next_prompt: the prompt stream's position (the next rollout's first prompt).
        cycle: the generation cycle to continue in.
        next_micro_step: the micro-step of ``cycle`` to continue at (0: the cycle's start).
        rollout: the cycle's rollout when the run continues in its middle, else None.
        log_window: the logging window's records since the last logged step.
    """

    global_step: int = 0
    num_tokens: int = 0
    next_prompt: int = 0
    cycle: int = 0
    next_micro_step: int = 0
    rollout: Rollout | None = None
    log_window: list[dict[str, float]] = field(default_factory=list)


def resume_point(resume: str | Path | bool | None, output_dir: str | Path) -> Path | None:
    """The checkpoint that ``resume`` names (see :func:`~grpo_plugins.checkpoint.resolve_resume`);
    for a fresh run (None), checks that ``output_dir`` holds no earlier run.

    Raises:
        CheckpointError: no such checkpoint, or an earlier run a fresh one would overwrite.
    """
    path = resolve_resume(resume, output_dir)
    if path is None:
        refuse_fresh_run_over(output_dir)
    return path


def _in_place(parts: RunParts, config: GRPOConfig) -> dict[str, Any]:
    """What a checkpoint saves and loads in place, as ``save_checkpoint``/``load_checkpoint``
    name it."""
    policy = parts.policy
    return dict(
        model=policy.unwrapped, optimizer=policy.optimizer, scheduler=parts.scheduler,
        scaler=parts.accelerator.scaler, master_weights=policy.master,
        ref_model=policy.ref_model if config.sync_ref_model else None,
    )


def save_run(
    parts: RunParts, config: GRPOConfig, output_dir: Path, at: Position, rng: dict[str, Any] | None = None
) -> Path:
    """Checkpoint the run at ``at`` with the RNG state ``rng`` (default: now's); every process
    calls this. Returns the checkpoint's directory."""
    acc, generator, entropy = parts.accelerator, parts.generator, parts.update.entropy
    state: dict[str, Any] = {
        "global_step": at.global_step,
        "cycle": at.cycle,
        "next_micro_step": at.next_micro_step,
        "mid_cycle": at.rollout is not None,
        "num_tokens": at.num_tokens,
        "next_prompt": at.next_prompt,
        "num_processes": acc.num_processes,
        "total_steps": parts.total_steps,
        "log_window": at.log_window,
    }
    if hasattr(generator, "state_dict"):
        state["generator"] = generator.state_dict()
    if entropy.enabled:
        state["entropy_control"] = entropy.state_dict()
    trained = parts.update.policy
    if config.train_pass_tokens == "auto" and trained.pass_tokens_known:  # sized: a resumed run plans the same passes
        state["train_pass_tokens"] = trained.pass_tokens()
    path = save_checkpoint(
        acc, output_dir, at.global_step, tokenizer=parts.policy.processor or parts.policy.tokenizer,
        rng_state=rng if rng is not None else capture_rng(),
        rollout=at.rollout.to_state() if at.rollout is not None else None, state=state,
        ahead=parts.rollouts.ahead.state() if parts.rollouts.ahead is not None else None,
        config_yaml=config.to_yaml(), save_total_limit=config.save_total_limit, **_in_place(parts, config),
    )
    parts.guard.last_checkpoint = path
    return path


def resume_run(path: Path, parts: RunParts, config: GRPOConfig) -> Position:
    """Load the checkpoint at ``path`` into the run's parts and this process's RNG streams;
    returns where the run continues."""
    acc, generator = parts.accelerator, parts.generator
    state, rng, saved = load_checkpoint(path, acc, **_in_place(parts, config))
    if "entropy_control" in state:
        parts.update.entropy.load_state_dict(state["entropy_control"])
    # Checkpoints from before dynamic sampling: one cycle, one batch of prompts.
    consumed = state["cycle"] + (1 if state.get("mid_cycle") else 0)
    if "generator" in state and hasattr(generator, "load_state_dict"):
        generator.load_state_dict(state["generator"])
    if "train_pass_tokens" in state and config.train_pass_tokens == "auto":
        parts.update.policy.pin_pass_tokens(state["train_pass_tokens"])  # the run's size, not one from the memory left now
    if rng is not None:
        restore_rng(rng)
    rollout = Rollout.from_state(saved, acc.device) if saved is not None else None
    if parts.rollouts.ahead is not None:  # the next cycle's completions, generated before the save
        parts.rollouts.ahead.load(load_ahead(path, acc.process_index))
    generator.on_weights_updated(parts.policy.unwrapped)
    parts.guard.last_checkpoint = path
    logger.info("resumed from %s at step %d", path, state["global_step"])
    return Position(
        global_step=state["global_step"],
        num_tokens=state["num_tokens"],
        next_prompt=state.get("next_prompt", consumed * parts.plan.unique_prompts),
        cycle=state["cycle"],
        next_micro_step=state["next_micro_step"],
        rollout=rollout,
        log_window=state.get("log_window", []),
    )
