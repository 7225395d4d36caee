"""What a component of each kind does on a small random input: the ``check_<kind>`` functions of
:data:`BEHAVIOUR_CHECKS`, each ``check(built, sample) -> problems`` (one sentence a problem)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import math
from collections.abc import Callable
from typing import Any

from grpo_plugins import kinds


def _tensor_problems(what: str, value: Any, shapes: list[tuple[int, ...]]) -> list[str]:
    import torch

    if not isinstance(value, torch.Tensor):
        return [f"{what} must return a torch.Tensor, got {type(value).__name__}"]
    if tuple(value.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        return [f"{what} returned shape {tuple(value.shape)}; expected {want}"]
    if not torch.isfinite(value).all():
        return [f"{what} returned non-finite values: {value.detach().tolist()}"]
    return []


_MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]  # rows of 5, 3 and 1 active tokens


def _loss_inputs(mask: Any, seed: int = 0) -> tuple[kinds.LossInputs, Any]:
    """A small random micro-batch as the core builds it, and the leaf tensor behind the log-probs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows, cols = mask.shape
    leaf = (-3.0 * torch.rand(rows, cols, generator=g)).requires_grad_()  # (B, T)
    logps = leaf * mask  # (B, T), 0 where masked, as the core gives them
    old = (logps.detach() + 0.3 * torch.randn(rows, cols, generator=g)) * mask  # (B, T)
    log_ratio = logps - old  # (B, T)
    values: dict[str, Any] = {
        "per_token_logps": logps,
        "old_per_token_logps": old,
        "advantages": torch.randn(rows, 1, generator=g),  # (B, 1)
        "mask": mask,
        "log_ratio": log_ratio,
        "log_weights": log_ratio,
        "ratio": torch.exp(log_ratio),
        "epsilon_low": 0.2,
        "epsilon_high": 0.28,
        "delta": None,
        "max_completion_length": cols,
        "num_items_in_batch": mask.sum() * 2,  # two micro-batches like this one per step
        "num_processes": 1,
        "gradient_accumulation_steps": 2,
    }
    fields = dataclasses.fields(kinds.LossInputs)
    unknown = [
        f.name
        for f in fields
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if unknown:  # kinds.LossInputs grew a field this helper does not know how to fill
        raise RuntimeError(f"grpo_plugins.testing cannot fill LossInputs field(s) {unknown}; update _loss_inputs")
    return kinds.LossInputs(**{f.name: values[f.name] for f in fields if f.name in values}), leaf


def check_loss_type(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a built loss_type (see :func:`check_component`)."""
    import torch

    mask = torch.tensor(_MASK, dtype=torch.float32)  # (B, T)
    rows, cols = mask.shape
    inputs, leaf = _loss_inputs(mask)
    per_token = built.per_token_loss(inputs)
    problems = _tensor_problems("per_token_loss", per_token, [(rows, cols), (rows, 1)])
    if problems:
        return problems
    per_token = per_token.expand(rows, cols)  # (B, T), as the core passes it to reduce
    loss = built.reduce(per_token, inputs)
    problems = _tensor_problems("reduce", loss, [()])
    if problems:
        return problems
    if not loss.requires_grad:
        return ["reduce returned a loss that carries no gradient"]
    loss.backward()
    if leaf.grad is None or not torch.isfinite(leaf.grad).all() or not leaf.grad.any():
        problems.append("the loss has no finite, non-zero gradient with respect to per_token_logps")
    with torch.no_grad():
        padded = per_token.detach() + (1 - mask) * 1e3  # garbage where masked
        if not torch.allclose(built.reduce(padded, inputs), built.reduce(per_token.detach(), inputs)):
            problems.append("reduce depends on masked positions: multiply the per-token loss by inputs.mask")
    empty, empty_leaf = _loss_inputs(torch.zeros(rows, cols))
    empty_loss = built.reduce(built.per_token_loss(empty).expand(rows, cols), empty)
    if not isinstance(empty_loss, torch.Tensor) or empty_loss.detach().item() != 0.0:
        value = empty_loss.detach().item() if isinstance(empty_loss, torch.Tensor) else empty_loss
        problems.append(
            f"with every token masked (all completions truncated under mask_truncated_completions) "
            f"reduce must return exactly 0, got {value}: clamp denominators with .clamp(min=1.0)"
        )
    elif empty_loss.requires_grad:
        empty_loss.backward()
        if empty_leaf.grad is not None and empty_leaf.grad.abs().sum().item() != 0.0:
            problems.append("with every token masked the gradient must be zero")
    metrics = getattr(built, "metrics", None)
    if callable(metrics):
        for name, values in metrics(inputs).items():
            if isinstance(values, kinds.RowExtremum):
                if values.reduce not in ("min", "max"):
                    problems.append(f"metrics()['{name}'] is a RowExtremum with reduce {values.reduce!r}; use 'min' or 'max'")
                values = values.values
            problems += _tensor_problems(f"metrics()['{name}']", values, [(rows, cols), (rows, 1)])
    return problems


def check_importance_sampling(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a built importance_sampling (see :func:`check_component`)."""
    import torch

    mask = torch.tensor(_MASK, dtype=torch.float32)  # (B, T)
    rows, cols = mask.shape
    leaf = (0.3 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))).requires_grad_()
    weights = built.log_weights(leaf * mask, mask)
    problems = _tensor_problems("log_weights", weights, [(rows, cols), (rows, 1)])
    if problems:
        return problems
    if not weights.requires_grad:
        problems.append("log_weights carry no gradient; the policy gradient flows only through the ratio")
    else:
        (weights.expand(rows, cols) * mask).sum().backward()
        if leaf.grad is None or not torch.isfinite(leaf.grad).all():
            problems.append("the gradient of log_weights is not finite")
    with torch.no_grad():
        on_policy = built.log_weights(torch.zeros(rows, cols), mask)
        if isinstance(on_policy, torch.Tensor) and not torch.allclose(on_policy, torch.zeros(())):
            problems.append(
                f"with log_ratio = 0 (on-policy) the log weights must be 0 (ratio 1), got {on_policy.tolist()}"
            )
        problems += _tensor_problems(
            "log_weights with every token masked",
            built.log_weights(torch.zeros(rows, cols), torch.zeros(rows, cols)),
            [(rows, cols), (rows, 1)],
        )
    return problems


def check_reward_scaling(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a built reward_scaling (see :func:`check_component`)."""
    import torch

    nan = float("nan")
    # Groups of 3: one with an unscorable row, one with zero std, one ordinary.
    rewards = torch.tensor([1.0, 2.0, nan, 3.0, 3.0, 3.0, 0.5, 1.5, 4.0])  # (N,)
    original = rewards.clone()
    advantages = built.advantages(rewards, 3)
    if not isinstance(advantages, torch.Tensor):
        return [f"advantages must return a torch.Tensor, got {type(advantages).__name__}"]
    if tuple(advantages.shape) != (9,):
        return [f"advantages returned shape {tuple(advantages.shape)}; expected (9,)"]
    problems: list[str] = []
    scorable = ~torch.isnan(original)
    if not torch.isfinite(advantages[scorable]).all():
        problems.append(
            f"advantages are not finite for scorable rows (a NaN row or a zero-std group): {advantages.tolist()}"
        )
    if not torch.equal(torch.nan_to_num(rewards, nan=-7.0), torch.nan_to_num(original, nan=-7.0)):
        problems.append("advantages modified its rewards argument in place")
    return problems


def check_rollout_correction(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a built rollout_correction (see :func:`check_component`)."""
    import torch

    mask = torch.tensor(_MASK, dtype=torch.float32)  # (B, T)
    rows, cols = mask.shape
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(rows, cols, generator=g) * mask  # (B, T)
    sampling = old + 0.7 * torch.randn(rows, cols, generator=g)  # (B, T)
    sampling[0, 0] = old[0, 0] - 1.5  # one token with a ratio of e^1.5, above the cap
    sampling = sampling * mask
    cap = 2.0
    weights = built.weights(old, sampling, mask, cap)
    problems = _tensor_problems("weights", weights, [(rows, cols), (rows, 1)])
    if problems:
        return problems
    if (weights < 0).any() or (weights > cap + 1e-6).any():
        problems.append(f"weights must lie in [0, cap={cap}], got {weights.tolist()}")
    same = built.weights(old, old, mask, cap)
    if isinstance(same, torch.Tensor):
        active = mask.bool() if same.shape[-1] == cols else torch.ones(rows, 1, dtype=torch.bool)
        if not torch.allclose(same[active], torch.ones(())):
            problems.append(f"when the sampler equals the policy the weights must be 1, got {same.tolist()}")
    problems += _tensor_problems(
        "weights with every token masked",
        built.weights(torch.zeros(rows, cols), torch.zeros(rows, cols), torch.zeros(rows, cols), cap),
        [(rows, cols), (rows, 1)],
    )
    return problems


def check_generator(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a built generator (see :func:`check_component`)."""
    # Generating needs a model; check_component only checks the static parts of a generator.
    value = getattr(built, "samples_from_policy", True)
    return [] if isinstance(value, bool) else [f"samples_from_policy must be a bool, got {value!r}"]


def check_group_filter(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a built group_filter (see :func:`check_component`)."""
    import torch

    nan = float("nan")
    # Groups of 3 with one reward: all wrong, mixed (with an unscorable row), all right.
    rewards = torch.tensor([[0.0], [0.0], [0.0], [1.0], [nan], [0.0], [1.0], [1.0], [1.0]])  # (N, K)
    total = rewards[:, 0].clone()  # (N,)
    originals = rewards.clone(), total.clone()
    problems: list[str] = []
    value = getattr(built, "drops_groups", True)
    if not isinstance(value, bool):
        problems.append(f"drops_groups must be a bool, got {value!r}")
    checker = getattr(built, "check_rewards", None)
    if checker is not None:
        checker(["correct"])
    keep = built.keep(rewards, total, ["correct"], 3)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or tuple(keep.shape) != (3,):
        shape = tuple(keep.shape) if isinstance(keep, torch.Tensor) else type(keep).__name__
        return problems + [f"keep must return a (N/G,) bool tensor, here (3,); got {shape}"]
    if value is False and not bool(keep.all()):
        problems.append(f"drops_groups is False but keep dropped groups: {keep.tolist()}")
    for got, original in zip((rewards, total), originals):
        if not torch.equal(torch.nan_to_num(got, nan=-7.0), torch.nan_to_num(original, nan=-7.0)):
            problems.append("keep modified its inputs in place")
            break
    return problems


def check_task(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a built task (see :func:`check_component`)."""
    problems: list[str] = []
    for i, entry in enumerate(getattr(built, "default_rewards", [])):
        if not (isinstance(entry, str) or (isinstance(entry, dict) and isinstance(entry.get("name"), str))):
            problems.append(f"default_rewards[{i}] must be a reward name or a mapping with 'name', got {entry!r}")
    dataset = built.load(0)
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        problems.append(f"load must return a datasets.Dataset, got {type(dataset).__name__}")
    elif "prompt" not in columns:
        problems.append(f"the dataset from load has no 'prompt' column (columns: {columns})")
    elif len(dataset) == 0:
        problems.append("the dataset from load is empty")
    load_eval = getattr(built, "load_eval", None)
    held_out = load_eval(0) if load_eval is not None else None
    if held_out is not None and not problems:
        eval_columns = getattr(held_out, "column_names", None)
        if eval_columns is None or "prompt" not in eval_columns:
            problems.append(f"load_eval must return None or a datasets.Dataset with a 'prompt' column, got {held_out!r}")
        else:
            train = {json.dumps(p, sort_keys=True) for p in dataset["prompt"]}
            shared = sum(json.dumps(p, sort_keys=True) in train for p in held_out["prompt"])
            if shared:
                problems.append(f"{shared} prompt(s) of load_eval(0) are also prompts of load(0); a held-out split must share none")
    return problems


def check_environment(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a built environment (see :func:`check_component`): run on two
    chat prompts with a scripted policy (``sample["reply"]``, default "4") and a tiny character
    tokenizer, its episodes must be consistent."""
    import tempfile

    from grpo_plugins.kinds import EnvironmentSettings
    from grpo_plugins.registry import get_registry
    from grpo_plugins.testing.scripted import ScriptedGenerator, scripted_setup
    from grpo_plugins.testing.tiny import build_tiny_tokenizer

    from transformers import AutoTokenizer

    budget = 24
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp)))
    generator = scripted_setup(ScriptedGenerator(sample.get("reply", "4")), tokenizer, budget)
    if getattr(built, "registry", None) is None:
        built.registry = get_registry()
    built.setup(generator, tokenizer, EnvironmentSettings(budget, int(tokenizer.pad_token_id), [int(tokenizer.eos_token_id)]))
    prompts = sample.get("prompts", [[{"role": "user", "content": "What is 2 plus 2?"}]] * 2)
    columns = {k: v for k, v in sample.items() if k not in ("reply", "prompts")}
    columns.setdefault("answer", ["4"] * len(prompts))
    ids = built.encode_prompts(prompts, None, "error")
    out = built.run(prompts, ids, columns)
    problems: list[str] = []
    B = len(prompts)
    shape = tuple(out.completion_ids.shape)
    if len(shape) != 2 or shape[0] != B:
        return [f"completion_ids must be (B={B}, T), got {shape}"]
    for field in ("completion_mask", "model_mask"):
        if tuple(getattr(out, field).shape) != shape:
            problems.append(f"{field} must have the shape of completion_ids {shape}, got {tuple(getattr(out, field).shape)}")
    if problems:
        return problems
    if bool((out.model_mask.bool() & ~out.completion_mask.bool()).any()):
        problems.append("model_mask marks tokens outside completion_mask")
    if int(out.model_mask.sum(1).max()) > budget:
        problems.append(f"an episode has more model tokens than max_completion_length={budget}")
    if tuple(out.is_truncated.shape) != (B,):
        problems.append(f"is_truncated must be (B={B},), got {tuple(out.is_truncated.shape)}")
    if out.sampling_logps is not None and tuple(out.sampling_logps.shape) != shape:
        problems.append(f"sampling_logps must be None or {shape}, got {tuple(out.sampling_logps.shape)}")
    if out.completions is not None and len(out.completions) != B:
        problems.append(f"completions must have one entry per prompt ({B}), got {len(out.completions)}")
    for kind, table in (("info", out.info), ("stats", out.stats)):
        for key, values in table.items():
            if len(values) != B:
                problems.append(f"{kind}['{key}'] must have one value per prompt ({B}), got {len(values)}")
    close = getattr(built, "close", None)
    if close is not None:
        close()
    return problems


def check_tool(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a tool (see :func:`check_component`): transformers'
    ``get_json_schema`` must describe it (type hints on every argument, an ``Args:`` docstring)."""
    from transformers.utils import get_json_schema

    try:
        get_json_schema(built)
    except Exception as exc:  # noqa: BLE001 - transformers' own parsing errors
        return [f"it cannot be described to the model: {exc} (give every argument a type hint and an Args: docstring entry)"]
    return []


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def check_reward(built: Any, sample: dict[str, Any]) -> list[str]:
    """The behaviour problems of a built reward (see :func:`check_component`)."""
    import numbers

    completions = sample.get("completions", ["4", "The answer is 4.", ""])
    kwargs: dict[str, Any] = {
        "prompts": sample.get("prompts", ["What is 2 + 2?"] * len(completions)),
        "completions": completions,
        "completion_ids": sample.get(
            "completion_ids",
            [[ord(ch) for ch in (c if isinstance(c, str) else c[-1]["content"])] for c in completions],
        ),
        **{k: v for k, v in sample.items() if k not in ("prompts", "completions", "completion_ids")},
    }
    try:
        sig = inspect.signature(built)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        missing = [
            p.name
            for p in sig.parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in kwargs
        ]
        if missing:
            return [
                f"it needs the argument(s) {missing}, which are not standard arguments: pass sample "
                f"dataset columns to check_component, e.g. sample={{{missing[0]!r}: [...]}}"
            ]
        kwargs = {k: v for k, v in kwargs.items() if k in sig.parameters}
    result = built(**kwargs)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    if isinstance(result, (str, bytes)) or not hasattr(result, "__len__"):
        return [f"it must return a list with one value per completion, got {type(result).__name__}"]
    if len(result) != len(completions):
        return [f"it returned {len(result)} values for {len(completions)} completions"]
    bad = [
        (i, v)
        for i, v in enumerate(result)
        if v is not None and not (isinstance(v, numbers.Real) and not math.isnan(float(v)))
    ]
    if bad:
        i, v = bad[0]
        return [f"value {i} is {v!r}; each value must be a float, or None for 'not applicable'"]
    return []


#: Each kind's behaviour check: ``check(built, sample) -> problems``.
BEHAVIOUR_CHECKS: dict[str, Callable[[Any, dict[str, Any]], list[str]]] = {
    "reward": check_reward,
    "loss_type": check_loss_type,
    "importance_sampling": check_importance_sampling,
    "reward_scaling": check_reward_scaling,
    "rollout_correction": check_rollout_correction,
    "generator": check_generator,
    "group_filter": check_group_filter,
    "environment": check_environment,
    "tool": check_tool,
    "task": check_task,
}
