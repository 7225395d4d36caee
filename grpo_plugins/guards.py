"""Failure handling of a training run, in one place.

The engine asks this module two things (the prompt-length check before the first step is
:func:`grpo_plugins.data.check_prompt_lengths`):

* :meth:`RunGuard.phase` -- a ``with`` block around generation, log-prob passes and training
  that turns a device out-of-memory error into :class:`DeviceOutOfMemoryError` (which phase,
  which step, the settings to turn with their current values, and the last complete
  checkpoint, which is left as it was) and an exception from a plugin's code into
  :class:`PluginRuntimeError` naming the component and its distribution.
* :meth:`RunGuard.check_rollout` and :meth:`RunGuard.check_update` -- NaN/inf in the rewards,
  the advantages, the loss or the gradients, found before the optimizer step. With
  ``on_nonfinite: stop`` the run stops with :class:`NonFiniteError` (step number and the
  component that produced the value); with ``skip`` the optimizer step is skipped. Either way
  nothing non-finite reaches the weights.
"""

from __future__ import annotations

import contextlib
import logging
import math
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_plugins.config import GRPOConfig, component_ref
from grpo_plugins.errors import GRPOPluginsError

if TYPE_CHECKING:
    from torch import Tensor

    from grpo_plugins.registry import Component, Registry

logger = logging.getLogger(__name__)

__all__ = [
    "DeviceOutOfMemoryError",
    "NonFiniteError",
    "PluginRuntimeError",
    "RunGuard",
    "is_out_of_memory",
    "out_of_memory_advice",
    "raising_component",
]



class NonFiniteError(GRPOPluginsError):
    """A NaN/inf reward, advantage, loss or gradient with ``on_nonfinite: stop``.

    Attributes:
        step: the optimizer step (1-based) the value belongs to.
        component: what produced it, e.g. ``reward 'acc'`` or ``loss_type 'dapo'``.
    """

    def __init__(self, message: str, *, step: int, component: str) -> None:
        super().__init__(message)
        self.step = step
        self.component = component


class PluginRuntimeError(GRPOPluginsError):
    """A plugin component raised while the run was using it.

    Attributes:
        component: the registry entry of the component (its kind, name and distribution).
    """

    def __init__(self, message: str, *, component: Any) -> None:
        super().__init__(message)
        self.component = component


class DeviceOutOfMemoryError(GRPOPluginsError):
    """The device ran out of memory; the message names the settings that reduce memory.

    Attributes:
        phase: ``generation``, ``log-probs`` or ``training``.
        step: the optimizer step being worked on (1-based).
        checkpoint: the last complete checkpoint (untouched), or None.
    """

    def __init__(self, message: str, *, phase: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.phase = phase
        self.step = step
        self.checkpoint = checkpoint


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an accelerator (or host allocator) out-of-memory error."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text or "not enough memory" in text
    )


def out_of_memory_advice(
    config: GRPOConfig, phase: str, generator_advice: Sequence[str] = (), pass_tokens: int | None = None
) -> list[str]:
    """The settings that lower peak memory in ``phase``, each with its current value;
    ``generator_advice`` (the generator's :meth:`~grpo_plugins.kinds.Generator.memory_advice`)
    comes after the run's own settings; ``pass_tokens``: what ``train_pass_tokens: auto``
    picked, if it did."""
    c = config
    batch = f"per_device_train_batch_size ({c.per_device_train_batch_size}; raise gradient_accumulation_steps to keep the batch)"
    length = f"max_completion_length ({c.max_completion_length})"
    chunk = f"logprob_chunk_size ({c.logprob_chunk_size})"
    four_bit = (
        ["load_in_4bit (false; QLoRA: the frozen base in 4 bits, about a quarter of its 16-bit size)"]
        if c.lora is not None and c.quantization_bits is None
        else []
    )
    if phase == "generation":
        spg = c.steps_per_generation or c.gradient_accumulation_steps
        return [
            f"steps_per_generation ({spg}; each process generates steps_per_generation x "
            f"per_device_train_batch_size = {spg * c.per_device_train_batch_size} completions at once)",
            length,
            f"per_device_train_batch_size ({c.per_device_train_batch_size})",
            *generator_advice,
            *four_bit,
        ]
    rows = c.train_chunk_rows
    suggestion = max(1, (rows or c.per_device_train_batch_size) // 4)
    chunk_rows = f"train_chunk_rows ({rows}; e.g. {suggestion}: that many rows per forward+backward, same results)"
    advice = [chunk_rows] if suggestion < c.per_device_train_batch_size else []
    if phase == "training":
        tokens = c.train_pass_tokens
        now = f"auto: {pass_tokens}" if tokens == "auto" and pass_tokens is not None else tokens
        bound = tokens if isinstance(tokens, int) else pass_tokens if tokens == "auto" else None
        advice.append(
            f"train_pass_tokens ({now}; e.g. {bound // 2 if bound else 8192}: at most that many rows x tokens per "
            "forward+backward, same results)"
        )
    if phase == "training" and c.gradient_checkpointing and not c.activation_offload:
        advice.append("activation_offload (false; true keeps the checkpointed layers' inputs in CPU memory)")
    advice += [batch, length, chunk]
    if phase == "training" and not c.gradient_checkpointing:
        advice.append("gradient_checkpointing (set it to true)")
    if phase == "training" and c.lora is None:
        advice.append("lora (train an adapter instead of all weights)")
    return [*advice, *generator_advice, *four_bit]


def raising_component(exc: BaseException, registry: Registry) -> Component | None:
    """The registered component whose code raised ``exc`` (the innermost one in its
    traceback), or None when no component's code is on it."""
    by_module: dict[str, list[Component]] = {}
    for component in registry.components():
        module = getattr(component.obj, "__module__", None)
        if module:
            by_module.setdefault(module, []).append(component)
    found: Component | None = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        candidates = by_module.get(frame.f_globals.get("__name__", ""), [])
        if not candidates:
            continue
        qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)

        def defines(c: Component) -> bool:
            own = getattr(c.obj, "__qualname__", None)
            return own is not None and (qualname == own or qualname.startswith(f"{own}."))

        found = next((c for c in candidates if defines(c)), candidates[0])
    return found


def _rows(values: Tensor) -> list[int]:
    import torch

    return torch.nonzero(values).flatten().tolist()


class RunGuard:
    """Watches one run for device out-of-memory and non-finite values.

    Args:
        config: the run config (``on_nonfinite``, the memory settings, component names).
        reward_names: one name per reward column.
    """

    def __init__(
        self,
        config: GRPOConfig,
        reward_names: Sequence[str],
        registry: Registry | None = None,
        generator_advice: Callable[[str], list[str]] | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.generator_advice = generator_advice
        self.reward_names = list(reward_names)
        self.last_checkpoint: Path | None = None
        self.skipped: list[tuple[int, str]] = []  # (step, component) of each skipped step
        self.pass_tokens: Callable[[], int | None] = lambda: None  # what train_pass_tokens: auto picked

    # -- out of memory ------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        """Run a phase (``generation``, ``log-probs``, ``training``) of optimizer step ``step``.

        An out-of-memory error inside becomes :class:`DeviceOutOfMemoryError`; any other
        exception raised by a plugin component's code becomes :class:`PluginRuntimeError`
        naming the component and its distribution (the original stays chained as the cause).
        """
        try:
            yield
        except GRPOPluginsError:
            raise
        except Exception as exc:
            if is_out_of_memory(exc):
                self._release_memory()
                raise self._oom_error(name, step, exc) from None
            component = raising_component(exc, self.registry) if self.registry is not None else None
            if component is None:
                raise
            raise PluginRuntimeError(
                f"{component.origin} raised {type(exc).__name__}: {exc} (during {name} of optimizer "
                f"step {step}); fix or update that plugin, or choose another {component.kind} "
                "(--debug shows the traceback)",
                component=component,
            ) from exc

    @staticmethod
    def _release_memory() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _oom_error(self, phase: str, step: int, exc: BaseException) -> DeviceOutOfMemoryError:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        extra: list[str] = []
        if self.generator_advice is not None:
            try:
                extra = list(self.generator_advice(phase))
            except Exception:  # a plugin's advice must not hide the out-of-memory error itself
                logger.debug("the generator's memory_advice failed", exc_info=True)
        knobs = "\n".join(f"  - {k}" for k in out_of_memory_advice(self.config, phase, extra, self.pass_tokens()))
        if self.last_checkpoint is not None:
            saved = (
                f"The last complete checkpoint, {self.last_checkpoint}, is intact: after changing the "
                "settings, continue from it with --resume (changing the batch settings changes the "
                "batch plan, so results will differ from an uninterrupted run)."
            )
        else:
            saved = "No checkpoint was written yet (set save_steps to checkpoint during the run)."
        message = (
            f"out of device memory during {phase} of optimizer step {step} ({first_line}).\n"
            f"Lower the memory this needs with one of:\n{knobs}\n{saved}"
        )
        return DeviceOutOfMemoryError(message, phase=phase, step=step, checkpoint=self.last_checkpoint)

    # -- non-finite values --------------------------------------------------------------------

    def check_rollout(self, rewards: Tensor, advantages: Tensor, step: int) -> str | None:
        """Check a generation batch's gathered rewards (N, K; NaN means "not applicable") and
        advantages (N,) before any training on it.

        Returns:
            None when all is finite, else the offending component (the steps trained on this
            batch are then skipped, see :meth:`check_update`).

        Raises:
            NonFiniteError: with ``on_nonfinite: stop``.
        """
        import torch

        inf = torch.isinf(rewards)  # (N, K)
        if bool(inf.any()):
            k = int(inf.any(0).float().argmax())
            rows = _rows(inf[:, k])
            return self._found(
                "reward",
                f"reward '{self.reward_names[k]}'",
                step,
                f"it scored {float(rewards[rows[0], k])} for sample(s) {rows[:5]} (a reward must be a "
                "finite number or None; a float above 3.4e38 becomes inf in float32)",
            )
        bad = ~torch.isfinite(advantages)  # (N,)
        if bool(bad.any()):
            scaling = component_ref(self.config.scale_rewards)
            assert scaling is not None
            return self._found(
                "advantage",
                f"reward scaling '{scaling.name}'",
                step,
                f"advantage {float(advantages[bad][0])} for sample(s) {_rows(bad)[:5]}",
            )
        return None

    def check_update(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        named_grads: Iterator[tuple[str, Any]] | Sequence[tuple[str, Any]] = (),
        rollout_problem: str | None = None,
        loss_scaling: bool = False,
    ) -> bool:
        """Decide, before the optimizer step, whether it may go ahead.

        Args:
            step: the optimizer step (1-based).
            loss: the step's loss, reduced over micro-steps and processes.
            grad_norm: the total gradient norm (before clipping), reduced over processes.
            named_grads: (parameter name, gradient) pairs, read only when ``grad_norm`` is not
                finite, to name the parameters.
            rollout_problem: what :meth:`check_rollout` found for this step's batch.
            loss_scaling: float16 with a gradient scaler: overflowing gradients (with a finite
                loss) are the scaler's business -- its step skips the update and lowers the
                scale -- so they neither stop nor count as skipped here.

        Returns:
            True when the step must be skipped (``on_nonfinite: skip``).

        Raises:
            NonFiniteError: with ``on_nonfinite: stop``.
        """
        if rollout_problem is not None:
            self._record_skip(step, rollout_problem)
            return True
        if not math.isfinite(loss):
            name = component_ref(self.config.loss_type)
            assert name is not None
            self._found(
                "loss",
                f"loss_type '{name.name}'",
                step,
                f"loss {loss} (the rewards and advantages of the batch were finite)",
            )
            self._record_skip(step, f"loss_type '{name.name}'")
            return True
        if not math.isfinite(grad_norm):
            if loss_scaling:
                logger.info("optimizer step %d: float16 gradients overflowed; the loss scale is lowered", step)
                return False
            params = self._nonfinite_params(named_grads)
            where = f"parameter(s) {', '.join(params[:3])}{' ...' if len(params) > 3 else ''}" if params else "the model"
            self._found(
                "gradient",
                f"the backward pass ({where})",
                step,
                f"grad_norm {grad_norm} while the loss was finite ({loss:.6g})",
            )
            self._record_skip(step, f"gradients of {where}")
            return True
        return False

    @staticmethod
    def _nonfinite_params(named_grads: Iterator[tuple[str, Any]] | Sequence[tuple[str, Any]]) -> list[str]:
        import torch

        return [
            name for name, grad in named_grads if grad is not None and not bool(torch.isfinite(grad).all())
        ]

    def _found(self, what: str, component: str, step: int, detail: str) -> str:
        """Stop (raise) or, with on_nonfinite skip, warn and return the component."""
        if self.config.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite {what} at optimizer step {step}, produced by {component}: {detail}. "
                "Nothing was written into the weights. Fix the component, lower the learning rate, "
                "or set on_nonfinite: skip to skip such steps.",
                step=step,
                component=component,
            )
        logger.warning("skipping optimizer step %d: non-finite %s from %s (%s)", step, what, component, detail)
        return component

    def _record_skip(self, step: int, component: str) -> None:
        if not self.skipped or self.skipped[-1][0] != step:
            self.skipped.append((step, component))
