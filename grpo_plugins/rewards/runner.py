"""Running a run's rewards on batches of completions (the TRL reward contract).

:class:`RewardRunner` calls all of a run's rewards concurrently (a thread each, async ones on one
event loop, ``executor: process`` ones in a worker process), applies each reward's timeout,
checks every returned value and returns an (N, K) float32 tensor with NaN for None. A failure
raises :class:`RewardError` naming the reward and the sample, unless that reward's ``on_error``
is ``"none"``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import math
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from grpo_plugins.config import GRPOConfig, RewardSpec, component_ref
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.registry import ComponentParamsError, Registry, UnknownComponentError, get_registry
from grpo_plugins.rewards.resolution import (
    RewardConfigError,
    as_spec,
    resolve_reward,
    reward_specs_for,
    reward_weights_mismatch,
)
from grpo_plugins.rewards.worker import CallFailed, ProcessWorker, await_result

if TYPE_CHECKING:
    from torch import Tensor

_RESERVED = ("prompts", "completions", "completion_ids", "prompt", "completion")
_REPR_CHARS = 80


class RewardError(GRPOPluginsError):
    """A reward raised, timed out, or returned something that is not one number/None per sample.

    Attributes:
        reward_name: the reward's name (as in ``rewards/<name>/mean``).
        sample_index: the index of the offending completion in the batch, or None when the
            failure concerns the whole batch (a timeout, a wrong number of values).
    """

    def __init__(
        self, message: str, *, reward_name: str, sample_index: int | None, detail: str | None = None
    ) -> None:
        super().__init__(message)
        self.reward_name = reward_name
        self.sample_index = sample_index
        self.detail = detail or message  # what went wrong, without the reward and the sample


class _MissingArgument(RewardError):
    """A reward needs a keyword argument that no dataset column provides (never None-able)."""


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= _REPR_CHARS else text[: _REPR_CHARS - 3] + "..."


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _accepted_kwargs(fn: Any) -> tuple[set[str] | None, set[str]]:
    """(names it accepts -- None when it takes **kwargs, required keyword names)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins, some C callables: pass everything
        return None, set()
    accepted: set[str] = set()
    required: set[str] = set()
    var_kw = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            accepted.add(p.name)
            if p.default is p.empty:
                required.add(p.name)
    return (None if var_kw else accepted), required


@dataclass
class _Reward:
    name: str
    fn: Any
    spec: RewardSpec
    is_async: bool
    accepted: set[str] | None
    required: set[str]
    worker: ProcessWorker | None


class RewardRunner:
    """Runs a run's rewards on batches of completions.

    Args:
        specs: the rewards -- :class:`RewardSpec` objects, names, ``{name, weight, params,
            on_error, timeout, executor}`` mappings, or reward callables/objects themselves.
        registry: where names are resolved (default: the process-wide registry).
        reward_weights: one weight per reward, replacing each spec's own weight (the one
            place a run's ``reward_weights`` are applied).

    Attributes:
        names: one name per reward (column k of the result), unique.
        weights: one weight per reward.
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec | str | dict[str, Any] | Callable[..., Any]],
        registry: Registry | None = None,
        reward_weights: Sequence[float] | None = None,
    ) -> None:
        registry = registry or get_registry()
        self._rewards: list[_Reward] = []
        used: set[str] = set()
        for i, entry in enumerate(specs):
            if callable(entry) and not isinstance(entry, (str, dict, RewardSpec)):
                fn, base = entry, getattr(entry, "__name__", type(entry).__name__)
                spec = RewardSpec(name=base)
            else:
                spec = as_spec(entry, f"rewards.{i}")  # type: ignore[arg-type]
                try:
                    component = resolve_reward(spec.name, registry)
                    fn = component.build(spec.params)
                except ComponentParamsError as exc:
                    raise RewardConfigError(f"rewards.{i}: {exc}") from None
                except (UnknownComponentError, RewardConfigError) as exc:
                    raise RewardConfigError(f"rewards.{i}: {exc}") from None
                base = component.name
            if reward_weights is not None and i < len(reward_weights):
                spec = spec.model_copy(update={"weight": float(reward_weights[i])})
            name, n = base, 2
            while name in used:  # two rewards of one name: rewards/x and rewards/x_2
                name, n = f"{base}_{n}", n + 1
            used.add(name)
            accepted, required = _accepted_kwargs(fn)
            self._rewards.append(
                _Reward(
                    name=name,
                    fn=fn,
                    spec=spec,
                    is_async=_is_async(fn),
                    accepted=accepted,
                    required=required,
                    worker=ProcessWorker(fn) if spec.executor == "process" else None,
                )
            )
        self.names: list[str] = [r.name for r in self._rewards]
        problem = reward_weights_mismatch(reward_weights, self.names)
        if problem is not None:
            raise RewardConfigError(f"reward_weights {problem}")
        self.weights: list[float] = [r.spec.weight for r in self._rewards]
        self._pool: cf.ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    # -- resources ----------------------------------------------------------------------------

    def _threads(self) -> cf.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(
                max_workers=max(1, len(self._rewards)), thread_name_prefix="reward"
            )
        return self._pool

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="reward-loop", daemon=True)
            thread.start()
            self._loop, self._loop_thread = loop, thread
        return self._loop

    def close(self) -> None:
        """Stop the threads, the event loop and the worker processes (and close rewards that
        have a ``close`` method)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(5)
            self._loop.close()
            self._loop = self._loop_thread = None
        for r in self._rewards:
            if r.worker is not None:
                r.worker.close()
            close = getattr(r.fn, "close", None)
            if callable(close) and not inspect.isfunction(r.fn):
                close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call -----------------------------------------------------------------------------

    def _kwargs(self, r: _Reward, base: dict[str, Any]) -> dict[str, Any]:
        missing = sorted(r.required - base.keys())
        if missing:
            cols = sorted(k for k in base if k not in ("prompts", "completions", "completion_ids", "trainer_state"))
            raise _MissingArgument(
                f"reward '{r.name}' needs the argument(s) {', '.join(map(repr, missing))}, which the "
                f"data does not provide (dataset columns: {', '.join(cols) or 'none'})",
                reward_name=r.name,
                sample_index=None,
            )
        if r.accepted is None:
            return dict(base)
        return {k: v for k, v in base.items() if k in r.accepted}

    def _submit(self, r: _Reward, kwargs: dict[str, Any]) -> cf.Future[Any]:
        timeout = r.spec.timeout
        if r.worker is not None:
            return self._threads().submit(r.worker.call, kwargs, timeout)
        if r.is_async:
            coro = asyncio.wait_for(await_result(r.fn(**kwargs)), timeout)
            return asyncio.run_coroutine_threadsafe(coro, self._event_loop())
        return self._threads().submit(self._call_sync, r.fn, kwargs)

    def _call_sync(self, fn: Any, kwargs: dict[str, Any]) -> Any:
        result = fn(**kwargs)
        if inspect.isawaitable(result):  # e.g. a functools.partial of an async function
            result = asyncio.run_coroutine_threadsafe(await_result(result), self._event_loop()).result()
        return result

    def _wait(self, r: _Reward, future: cf.Future[Any], deadline: float | None) -> Any:
        """The raw result, or CallFailed."""
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            return future.result(timeout=remaining)
        except cf.TimeoutError as exc:  # also asyncio's: the same class since Python 3.11
            if r.spec.timeout is None:  # the reward raised TimeoutError itself
                raise CallFailed(f"{type(exc).__name__}: {exc}") from exc
            future.cancel()
            if r.worker is None and not r.is_async and not future.done():
                # A thread cannot be killed: abandon it and give later calls fresh threads.
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                    self._pool = None
            raise CallFailed(f"timed out after {r.spec.timeout:g} s", timed_out=True) from None
        except CallFailed:
            raise
        except RewardError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reward's own exception
            raise CallFailed(f"{type(exc).__name__}: {exc}") from exc

    # -- checking -----------------------------------------------------------------------------

    @staticmethod
    def _to_float(value: Any) -> float | None | str:
        """A float, None, or a string saying what is wrong."""
        if value is None:
            return None
        x: Any = value
        if not isinstance(value, (str, bytes, numbers.Real)) and callable(getattr(value, "item", None)):
            try:  # a one-element tensor or array
                x = value.item()
            except (ValueError, RuntimeError):
                pass
        if isinstance(x, (str, bytes)) or not isinstance(x, numbers.Real):
            return f"a {type(value).__name__} ({_short(value)}), not a number"
        x = float(x)
        if not math.isfinite(x):
            return f"{x} (rewards must be finite; return None for 'not applicable')"
        return x

    def _sample_repr(self, i: int, prompts: list[Any], completions: list[Any]) -> str:
        return f"prompt {_short(prompts[i])}, completion {_short(completions[i])}"

    def _check(
        self, r: _Reward, result: Any, n: int, prompts: list[Any], completions: list[Any]
    ) -> list[float | None]:
        if hasattr(result, "tolist") and not isinstance(result, list):
            result = result.tolist()
        if not isinstance(result, (list, tuple)):
            raise self._fail(r, f"returned a {type(result).__name__}, not a list of {n} values", None)
        if len(result) != n:
            raise self._fail(r, f"returned {len(result)} values for {n} completions", None)
        out: list[float | None] = []
        for i, value in enumerate(result):
            x = self._to_float(value)
            if isinstance(x, str):
                if r.spec.on_error == "none":
                    out.append(None)
                    continue
                raise self._fail(r, f"returned {x}", i, self._sample_repr(i, prompts, completions))
            out.append(x)
        return out

    @staticmethod
    def _fail(r: _Reward, what: str, index: int | None, sample: str | None = None) -> RewardError:
        where = f" for sample {index} ({sample})" if index is not None else ""
        hint = "" if r.spec.on_error == "none" else " (set on_error: none on this reward to score failures as None)"
        return RewardError(
            f"reward '{r.name}' {what}{where}{hint}", reward_name=r.name, sample_index=index, detail=what
        )

    def _retry_per_sample(
        self, r: _Reward, kwargs: dict[str, Any], n: int, prompts: list[Any], completions: list[Any], what: str
    ) -> list[float | None]:
        """After a batch call raised: call sample by sample to find (and, with on_error none,
        keep) what works; raises the first failing sample's error with on_error raise."""
        out: list[float | None] = []
        for i in range(n):
            one = {k: (v[i : i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
            try:
                timeout = None if r.spec.timeout is None or r.worker else r.spec.timeout
                deadline = None if timeout is None else time.monotonic() + timeout
                values = self._check(r, self._wait(r, self._submit(r, one), deadline), 1, prompts[i : i + 1], completions[i : i + 1])
                out.append(values[0])
            except (CallFailed, RewardError) as exc:
                if r.spec.on_error == "none":
                    out.append(None)
                    continue
                detail = f"raised {exc.what}" if isinstance(exc, CallFailed) else exc.detail
                raise self._fail(r, detail, i, self._sample_repr(i, prompts, completions)) from None
        if r.spec.on_error != "none":  # every sample works alone: the batch itself is the problem
            raise self._fail(r, f"raised {what} on the batch of {n} samples (each sample alone scores fine)", None)
        return out

    # -- the batch ----------------------------------------------------------------------------

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        columns: dict[str, list[Any]] | None = None,
        step: int | None = None,
    ) -> Tensor:
        """Score N completions with every reward -> (N, K) float32 tensor, NaN where None.

        Completions may be given as text; for conversational prompts (lists of messages) they
        are passed on as ``[{"role": "assistant", "content": text}]``, as TRL does.

        Raises:
            RewardError: the first failing reward (in config order) whose on_error is "raise".
        """
        import torch

        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions")
        completions = [
            [{"role": "assistant", "content": c}] if isinstance(c, str) and isinstance(p, list) else c
            for p, c in zip(prompts, completions)
        ]
        columns = {k: v for k, v in (columns or {}).items() if k not in _RESERVED}
        for key, values in columns.items():
            if len(values) != n:
                raise ValueError(f"column '{key}' has {len(values)} values for {n} completions")
        base: dict[str, Any] = {
            "prompts": list(prompts),
            "completions": completions,
            "completion_ids": [list(ids) for ids in completion_ids] if completion_ids is not None else None,
            **{k: list(v) for k, v in columns.items()},
            "trainer_state": SimpleNamespace(global_step=step if step is not None else 0),
        }
        if completion_ids is None:
            base.pop("completion_ids")

        start = time.monotonic()
        pending: list[tuple[_Reward, dict[str, Any], cf.Future[Any] | None, Exception | None]] = []
        for r in self._rewards:
            try:
                kwargs = self._kwargs(r, base)
                pending.append((r, kwargs, self._submit(r, kwargs), None))
            except Exception as exc:  # noqa: BLE001 - a sync submit error, reported in order below
                pending.append((r, {}, None, exc))

        table: list[list[float | None]] = []
        first_error: RewardError | None = None
        for r, kwargs, future, error in pending:
            values: list[float | None]
            try:
                if error is not None:
                    raise error
                assert future is not None
                # A worker process enforces its own timeout (and kills itself on it).
                deadline = None if r.spec.timeout is None or r.worker else start + r.spec.timeout
                values = self._check(r, self._wait(r, future, deadline), n, prompts, completions)
            except CallFailed as exc:
                if exc.timed_out:
                    if r.spec.on_error == "none":
                        values = [None] * n
                    else:
                        values = [None] * n
                        first_error = first_error or self._fail(
                            r, f"{exc.what} on the batch of samples 0..{n - 1} (first: {self._sample_repr(0, prompts, completions) if n else '-'})", None
                        )
                else:
                    try:
                        values = self._retry_per_sample(r, kwargs, n, prompts, completions, exc.what)
                    except RewardError as err:
                        values, first_error = [None] * n, first_error or err
            except RewardError as err:
                if r.spec.on_error == "none" and not isinstance(err, _MissingArgument):
                    values = [None] * n
                else:
                    values, first_error = [None] * n, first_error or err
            except Exception as exc:  # noqa: BLE001 - e.g. calling an async reward failed at once
                err = self._fail(r, f"raised {type(exc).__name__}: {exc}", None)
                if r.spec.on_error == "none":
                    values = [None] * n
                else:
                    values, first_error = [None] * n, first_error or err
            table.append(values)
        if first_error is not None:
            raise first_error
        out = torch.tensor(
            [[math.nan if table[k][i] is None else table[k][i] for k in range(len(table))] for i in range(n)],
            dtype=torch.float32,
        )
        return out.reshape(n, len(self._rewards))  # (N, K)


def reward_runner(
    config: GRPOConfig, registry: Registry, rewards: Sequence[Callable[..., Any]] | None = None, task: Any = None
) -> RewardRunner:
    """The rewards of a run: the given callables (weighted by ``config.reward_weights``), else
    ``config.rewards``, else the task's default rewards (``task`` built, or looked up)."""
    if rewards is None:
        ref = component_ref(config.task)
        if task is None and ref is not None and not config.rewards:
            task = registry.get("task", ref.name)  # only its default rewards
        rewards = reward_specs_for(config, task)
    return RewardRunner(list(rewards), registry, reward_weights=config.reward_weights)
