"""Environments: multi-turn episodes with tools, on a tiny model with a scripted policy.

The scripted policy (``ScriptedGenerator``) answers with fixed text, so every token of an
episode is known in advance: the tests re-derive masks, log-probs, losses and gradients
independently, from the plain token sequences, and compare them with the engine's.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.engine import Engine
from grpo_plugins.kinds import EnvironmentSettings
from grpo_plugins.registry import get_registry
from grpo_plugins.testing import ScriptedGenerator, build_tiny_tokenizer, registered_component, scripted_setup, tiny_model_spec
from grpo_plugins.update import AccumulationWindow

from builtin_environments import ToolCalling

# Groups of two keep the scripted batches small; the planner's warning about it is expected.
pytestmark = pytest.mark.filterwarnings("ignore:num_generations is 2")

CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'
ROWS = [
    {"prompt": [{"role": "user", "content": "What is 123 times 456?"}], "answer": "56088"},
    {"prompt": [{"role": "user", "content": "What is 77 times 88?"}], "answer": "6776"},
]
#: What the tiny chat template puts between a model turn and the next: the tool message.
TOOL_REPLY = "\n<|tool|>{result}\n<|assistant|>"


class Policy:
    """The scripted policy: the k-th first turn alternates between calling the calculator
    (then answering with its result) and answering straight away with a wrong number."""

    def __init__(self) -> None:
        self.first_turns = itertools.count()

    def __call__(self, prompt: str) -> str:
        a, b = map(int, re.findall(r"What is (\d+) times (\d+)", prompt)[-1])
        if "<|tool|>" in prompt:
            result = prompt.rsplit("<|tool|>", 1)[1].split("\n", 1)[0]
            return f"<answer>{result}</answer>"
        if next(self.first_turns) % 2 == 0:
            return CALL.format(a=a, b=b)
        return f"<answer>{a * b + 1}</answer>"


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny random Llama with room for multi-turn episodes (1024 positions)."""
    return tiny_model_spec(tmp_path_factory.mktemp("tiny_env"), "llama", max_position_embeddings=1024)


@pytest.fixture()
def tokenizer(tmp_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp_path / "tok")))


def tool_env(tokenizer: Any, reply: Any, budget: int = 200, **params: Any) -> ToolCalling:
    env = ToolCalling(ToolCalling.Params(tools_in="template", **params))
    env.registry = get_registry()
    generator = scripted_setup(ScriptedGenerator(reply), tokenizer, budget)
    env.setup(generator, tokenizer, EnvironmentSettings(budget, tokenizer.pad_token_id, [tokenizer.eos_token_id]))
    return env


def ntokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode_where(tokenizer: Any, ids: torch.Tensor, mask: torch.Tensor) -> str:
    return tokenizer.decode(ids[mask.bool()].tolist())


# -- episodes ------------------------------------------------------------------------------------


def test_tool_call_episode_masks_exactly_the_model_tokens(tokenizer: Any) -> None:
    env = tool_env(tokenizer, Policy())
    prompts = [r["prompt"] for r in ROWS]
    out = env.run(prompts, env.encode_prompts(prompts, None, "error"), {})
    call = CALL.format(a=123, b=456)
    # Row 0 called the tool: two model turns, each ended by the model's EOS, the tool's message between.
    assert decode_where(tokenizer, out.completion_ids[0], out.model_mask[0]) == f"{call}</s><answer>56088</answer></s>"
    env_mask = out.completion_mask[0] - out.model_mask[0]
    assert decode_where(tokenizer, out.completion_ids[0], env_mask) == TOOL_REPLY.format(result=56088)
    # The order in the sequence: call, tool message, answer.
    n_call = len(call) + 1
    n_env = ntokens(tokenizer, TOOL_REPLY.format(result=56088))  # <|assistant|> is one token
    assert out.model_mask[0, :n_call].all() and not out.model_mask[0, n_call : n_call + n_env].any()
    assert out.model_mask[0, n_call + n_env :].sum() == len("<answer>56088</answer>") + 1
    # Row 1 answered at once: one turn, no environment tokens.
    assert out.completion_mask[1].sum() == out.model_mask[1].sum() == len("<answer>6777</answer>") + 1
    assert out.stats == {"turns": [2.0, 1.0], "tool_calls": [1.0, 0.0], "tool_errors": [0.0, 0.0]}
    assert out.info == {"num_tool_calls": [1, 0], "num_tool_errors": [0, 0]}
    # Sampling log-probs sit on the model's tokens only (the scripted sampler reports -0.5).
    assert torch.equal(out.sampling_logps[0] != 0, out.model_mask[0].bool())
    assert out.completions[0][1] == {"role": "tool", "name": "calculator", "content": "56088"}
    assert out.completions[0][0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "123*456"}}
    assert not out.is_truncated.any()


def test_the_whole_batch_advances_turn_by_turn_in_one_generate_call_per_turn(tokenizer: Any) -> None:
    env = tool_env(tokenizer, Policy())
    prompts = [r["prompt"] for r in ROWS] * 2
    env.run(prompts, env.encode_prompts(prompts, None, "error"), {})
    calls = env.generator.calls
    assert [len(c) for c in calls] == [4, 2]  # rows 0 and 2 called the tool: only they get a second turn
    assert calls[1][0][-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")  # re-prompted after the tool message


def test_the_token_budget_counts_only_model_tokens_and_truncates_the_episode(tokenizer: Any) -> None:
    call = CALL.format(a=123, b=456)
    budget = len(call) + 1 + 5  # the call, its EOS, and 5 tokens of the answer
    env = tool_env(tokenizer, Policy(), budget=budget)
    prompts = [ROWS[0]["prompt"]]
    out = env.run(prompts, env.encode_prompts(prompts, None, "error"), {})
    assert out.model_mask.sum() == budget
    assert out.completion_mask.sum() == budget + ntokens(tokenizer, TOOL_REPLY.format(result=56088))
    assert out.is_truncated.tolist() == [True]
    assert decode_where(tokenizer, out.completion_ids[0], out.model_mask[0]).endswith("</s><answ")


def test_max_tool_calling_iterations_ends_the_episode(tokenizer: Any) -> None:
    always_call = lambda prompt: CALL.format(a=2, b=3)  # noqa: E731
    env = tool_env(tokenizer, always_call, budget=400, max_tool_calling_iterations=2)
    prompts = [ROWS[0]["prompt"]]
    out = env.run(prompts, env.encode_prompts(prompts, None, "error"), {})
    assert out.stats["turns"] == [3.0] and out.stats["tool_calls"] == [2.0]
    assert not out.is_truncated.any()


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>', "Error: ZeroDivisionError: division by zero"),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "Error: unknown tool 'nope'; the tools are: calculator"),
        ('<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>', "Error: TypeError: calculator() got an unexpected keyword argument 'x'"),
        ("<tool_call>not json</tool_call>", "Error: the tool call is not valid JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>', "Error: ValueError: only numbers"),
    ],
)
def test_tool_errors_become_the_tool_message(tokenizer: Any, turn: str, message: str) -> None:
    env = tool_env(tokenizer, lambda p: "done" if "<|tool|>" in p else turn)
    prompts = [ROWS[0]["prompt"]]
    out = env.run(prompts, env.encode_prompts(prompts, None, "error"), {})
    assert out.completions[0][1]["content"].startswith(message)
    assert out.stats["tool_errors"] == [1.0] and out.stats["turns"] == [2.0]


def test_a_slow_tool_times_out_into_its_message(tokenizer: Any) -> None:
    import time

    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke"

    env = ToolCalling(ToolCalling.Params(tools=[], tools_in="template", tool_timeout=0.2), functions=[slow])
    generator = scripted_setup(
        ScriptedGenerator(lambda p: "ok" if "<|tool|>" in p else '<tool_call>{"name": "slow", "arguments": {"seconds": 2}}</tool_call>'),
        tokenizer,
        200,
    )
    env.setup(generator, tokenizer, EnvironmentSettings(200, tokenizer.pad_token_id, [tokenizer.eos_token_id]))
    start = time.monotonic()
    out = env.run([ROWS[0]["prompt"]], env.encode_prompts([ROWS[0]["prompt"]], None, "error"), {})
    assert time.monotonic() - start < 1.5
    assert out.completions[0][1]["content"] == "Error: tool 'slow' timed out after 0.2 seconds"
    env.close()


def test_trl_style_tool_functions_run_unchanged(tokenizer: Any) -> None:
    # The tool functions of TRL's documentation (type hints, Google docstring), sync and async.
    def multiply(a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        return a * b

    async def get_weather(city: str, unit: str = "celsius") -> dict:
        """
        Gets the weather of a city.

        Args:
            city: The city.
            unit: The unit of temperature.
        """
        return {"city": city, "temperature": 21, "unit": unit}

    turn = (
        '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    env = ToolCalling(ToolCalling.Params(tools=[], tools_in="template"), functions=[multiply, get_weather])
    generator = scripted_setup(ScriptedGenerator(lambda p: "ok" if "<|tool|>" in p else turn), tokenizer, 200)
    env.setup(generator, tokenizer, EnvironmentSettings(200, tokenizer.pad_token_id, [tokenizer.eos_token_id]))
    assert [s["function"]["name"] for s in env.schemas] == ["multiply", "get_weather"]
    assert env.schemas[0]["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first integer."}
    out = env.run([ROWS[0]["prompt"]], env.encode_prompts([ROWS[0]["prompt"]], None, "error"), {})
    assert [m["content"] for m in out.completions[0][1:3]] == ["408", '{"city": "Paris", "temperature": 21, "unit": "celsius"}']
    env.close()


def test_tools_reach_the_prompt_through_the_template_or_a_system_message(tokenizer: Any) -> None:
    env = tool_env(tokenizer, "x")
    env.params = env.params.model_copy(update={"tools_in": "system_prompt"})
    env._in_template = False
    ids = env.encode_prompts([ROWS[0]["prompt"]], None, "error")
    text = tokenizer.decode(ids[0])
    assert text.startswith("<|system|>You can call these tools:\n{\"name\": \"calculator\"")
    assert text.endswith("<|user|>What is 123 times 456?\n<|assistant|>")


def test_a_template_that_renders_tools_gets_them_as_tools(tokenizer: Any) -> None:
    tokenizer.chat_template = (
        "{% if tools %}<|system|>TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
        + tokenizer.chat_template
    )
    env = ToolCalling()
    env.registry = get_registry()
    env.setup(scripted_setup(ScriptedGenerator("x"), tokenizer), tokenizer, EnvironmentSettings(8, 0, [2]))
    assert env.chat_template_kwargs() == {"tools": env.schemas}
    text = tokenizer.decode(env.encode_prompts([ROWS[0]["prompt"]], None, "error")[0])
    assert text.startswith("<|system|>TOOLS:calculator;<|user|>")


def test_plain_text_prompts_get_tagged_tool_responses(tokenizer: Any) -> None:
    env = tool_env(tokenizer, lambda p: "<answer>6</answer>" if "<tool_response>" in p else CALL.format(a=2, b=3))
    out = env.run(["What is 2 times 3?"], env.encode_prompts(["What is 2 times 3?"], None, "error"), {})
    env_mask = out.completion_mask[0] - out.model_mask[0]
    assert decode_where(tokenizer, out.completion_ids[0], env_mask) == "\n<tool_response>\n6\n</tool_response>\n"
    assert out.completions[0].endswith("\n<tool_response>\n6\n</tool_response>\n<answer>6</answer>")


@pytest.mark.parametrize(
    ("expression", "value"),
    [("1234 * 5678", "7006652"), ("(7 + 5) / 4", "3"), ("7 / 2", "3.5"), ("2 ** 10 - 1", "1023"), ("-3 // 2", "-2"), ("1,000 × 3", "3000")],
)
def test_calculator_is_exact(expression: str, value: str) -> None:
    from builtin_environments.tools import calculator

    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "(1).__class__", "x + 1", "9 ** 9 ** 9", "10 ** 2000 * 10 ** 2000", "'a' * 3", "[1] * 3"],
)
def test_calculator_refuses_everything_but_arithmetic(expression: str) -> None:
    from builtin_environments.tools import calculator

    with pytest.raises((ValueError, ZeroDivisionError)):
        calculator(expression)


# -- the engine: masks, log-probs, loss and gradient across turns ---------------------------------


class Scripted(ScriptedGenerator):
    """The scripted policy as a registered generator (built with no arguments)."""

    def __init__(self) -> None:
        super().__init__(Policy())


def _config(model: dict, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    base = {
        "model": model,
        "task": None,
        "rewards": ["correct_answer"],
        "generator": "scripted",
        "environment": {"name": "tool_calling", "params": {"tools_in": "template"}},
        "output_dir": str(tmp_path / "out"),
        "max_steps": 1,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_generations": 2,
        "max_completion_length": 120,
        "max_prompt_length": None,
        "learning_rate": 1e-3,
        "report_to": ["jsonl"],
        "seed": 0,
        "dtype": "float32",
    }
    base.update(overrides)
    return base


@pytest.fixture()
def engine_factory(tiny_long: dict, tmp_path: Path):
    engines: list[Engine] = []

    def make(**overrides: Any) -> Engine:
        engine = Engine(_config(tiny_long, tmp_path, **overrides), dataset=list(ROWS))
        engine._setup()
        engines.append(engine)
        return engine

    with registered_component("generator", Scripted, "scripted"):
        yield make
    for engine in engines:
        engine._teardown()


def _reference_logps(model: Any, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion token | everything before it), from one plain forward pass."""
    seq = torch.tensor([prompt + completion])
    logits = model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float()  # (T, V)
    return torch.log_softmax(logits, -1).gather(-1, seq[0, len(prompt) :, None])[:, 0]  # (T,)


def test_engine_log_probs_loss_and_gradient_across_turns_match_a_plain_re_derivation(engine_factory) -> None:
    # Off-policy plan (an update inside the cycle) so the rollout carries old log-probs to compare.
    engine = engine_factory(steps_per_generation=2, per_device_train_batch_size=2)
    rollout = engine.rollouts.make(0, 1)
    tok, model = engine.tokenizer, engine.unwrapped
    P = rollout.input_ids.shape[1] - rollout.loss_mask.shape[1]
    for row in range(4):
        att = rollout.attention_mask[row].bool()
        prompt = rollout.input_ids[row, :P][att[:P]].tolist()
        completion = rollout.input_ids[row, P:][att[P:]].tolist()
        with torch.no_grad():
            expected = _reference_logps(model, prompt, completion)
        m = rollout.loss_mask[row, : len(completion)]
        text = tok.decode(torch.tensor(completion)[m.bool()].tolist())
        assert text.endswith("</answer></s>")
        # Old log-probs: the plain forward's on the model's tokens, exactly 0 on the environment's.
        torch.testing.assert_close(rollout.old_logps[row, : len(completion)], expected * m, atol=1e-5, rtol=0)
    # Rows 0 and 2 called the tool (two turns), rows 1 and 3 answered wrongly at once.
    assert rollout.metrics["env/turns"] == 1.5 and rollout.metrics["env/tool_calls"] == 0.5
    assert rollout.metrics["env/environment_tokens"] == pytest.approx(
        (ntokens(tok, TOOL_REPLY.format(result=56088)) + ntokens(tok, TOOL_REPLY.format(result=6776))) / 4
    )
    assert rollout.advantages.tolist() == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-3)

    # One micro-step's gradient equals autograd of the loss re-derived from the plain sequences.
    step = engine.plan.cycle(0, 0)[0]
    model.zero_grad(set_to_none=True)
    engine.update.micro_step(rollout, step, rollout.window_items[0], AccumulationWindow())
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    items = rollout.loss_mask[step.rows].sum()
    total = torch.zeros(())
    for row in range(4)[step.rows]:
        att = rollout.attention_mask[row].bool()
        prompt = rollout.input_ids[row, :P][att[:P]].tolist()
        completion = rollout.input_ids[row, P:][att[P:]].tolist()
        logp = _reference_logps(model, prompt, completion)
        m = rollout.loss_mask[row, : len(completion)]
        old = rollout.old_logps[row, : len(completion)]
        ratio = torch.exp(logp - old)  # 1 in value: old is this very policy, but carries the gradient
        total = total + (-(ratio * rollout.advantages[row]) * m).sum()
    (total / items).backward()
    for name, grad in got.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in got.values())


def test_engine_loss_counts_only_model_tokens(engine_factory) -> None:
    engine = engine_factory()
    result = engine._run(None)
    record = result.history[0]
    # dapo, on-policy: loss = -sum_i A_i * n_i / sum_i n_i with n_i the model tokens of episode i.
    call = len(CALL.format(a=123, b=456)) + 1
    n = {
        0: call + len("<answer>56088</answer>") + 1, 1: len("<answer>56089</answer>") + 1,
        2: len(CALL.format(a=77, b=88)) + 1 + len("<answer>6776</answer>") + 1, 3: len("<answer>6777</answer>") + 1,
    }
    a = 0.5 / (2 ** 0.5 * 0.5 + 1e-4)  # rewards (1, 0) per group: std = 0.7071
    advantages = {0: a, 1: -a, 2: a, 3: -a}
    expected = -sum(advantages[i] * n[i] for i in n) / sum(n.values())
    assert record["loss"] == pytest.approx(expected, rel=1e-5)
    assert record["env/turns"] == 1.5 and record["env/tool_errors"] == 0.0
    assert record["env/model_tokens"] == pytest.approx(sum(n.values()) / 4)
    assert record["completions/mean_length"] == pytest.approx(sum(n.values()) / 4)
    assert record["rewards/correct_answer/mean"] == 0.5


def test_truncated_episodes_are_masked_per_episode(engine_factory) -> None:
    # A budget that ends inside the answer turn of the tool-calling episodes (rows 0 and 2) only.
    budget = len(CALL.format(a=123, b=456)) + 1 + 3
    engine = engine_factory(max_completion_length=budget, mask_truncated_completions=True)
    rollout = engine.rollouts.make(0, 1)
    lengths = rollout.loss_mask.sum(1).tolist()
    assert lengths[0] == 0 and lengths[2] == 0  # truncated: masked entirely
    assert lengths[1] == len("<answer>56089</answer>") + 1 and lengths[3] == len("<answer>6777</answer>") + 1
    assert rollout.metrics["completions/clipped_ratio"] == 0.5


def test_all_masked_episodes_give_zero_loss_and_do_not_move_the_model(engine_factory) -> None:
    engine = engine_factory(max_completion_length=10, mask_truncated_completions=True)
    before = {k: v.detach().clone() for k, v in engine.unwrapped.named_parameters()}
    record = engine._run(None).history[0]
    assert record["loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in engine.unwrapped.named_parameters())
    assert all(v == v for v in record.values() if isinstance(v, float))  # no NaN anywhere


@pytest.mark.parametrize("generator", ["transformers", "static"])
def test_tool_calling_runs_with_the_sampling_generators(tiny_long: dict, tmp_path: Path, generator: str) -> None:
    config = _config(tiny_long, tmp_path, generator=generator, max_completion_length=8, max_steps=1)
    result = Engine(config, dataset=list(ROWS)).train()
    assert result.global_step == 1
    assert {"env/turns", "env/tool_calls", "env/tool_errors", "env/model_tokens", "env/environment_tokens"} <= set(result.metrics)


def test_single_turn_is_the_default_and_reports_no_env_metrics(tiny_long: dict, tmp_path: Path) -> None:
    config = _config(tiny_long, tmp_path, generator="transformers", max_completion_length=4)
    del config["environment"]
    result = Engine(config, dataset=list(ROWS)).train()
    assert not any(k.startswith("env/") for k in result.metrics)


def test_builtin_environments_register_without_importing_torch() -> None:
    import subprocess
    import sys

    code = "import sys, builtin_environments; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_config_names_the_environment_and_validate_checks_its_params() -> None:
    from grpo_plugins.config import ConfigError
    from grpo_plugins.validation import validate_config

    config = {"environment": {"name": "tool_calling", "params": {"tools": ["calculator"], "max_tool_calling_iterations": 3}}}
    assert validate_config(config).environment.name == "tool_calling"
    with pytest.raises(ConfigError, match=r"environment\.params\.max_tool_calls.*max_tool_calling_iterations"):
        validate_config({"environment": {"name": "tool_calling", "params": {"max_tool_calls": 3}}})
    with pytest.raises(ConfigError, match=r"environment\.params\.tools: unknown tool 'calculater'; did you mean 'calculator'"):
        validate_config({"environment": {"name": "tool_calling", "params": {"tools": ["calculater"]}}})
    with pytest.raises(ConfigError, match="unknown environment 'multi_turn'"):
        validate_config({"environment": "multi_turn"})


def test_engine_takes_a_built_environment_with_unregistered_tool_functions(tiny_long: dict, tmp_path: Path) -> None:
    calls: list[str] = []

    def calculator(expression: str) -> str:
        """My own calculator.

        Args:
            expression: What to compute.
        """
        calls.append(expression)
        a, b = expression.split("*")
        return str(int(a) * int(b))

    env = ToolCalling(ToolCalling.Params(tools=[], tools_in="template"), functions=[calculator])
    config = _config(tiny_long, tmp_path)
    del config["environment"]
    with registered_component("generator", Scripted, "scripted"):
        result = Engine(config, dataset=list(ROWS), environment=env).train()
    assert calls == ["123*456", "77*88"]
    assert result.metrics["env/tool_calls"] == 0.5 and result.metrics["rewards/correct_answer/mean"] == 0.5


def test_the_configs_chat_template_kwargs_reach_prompts_and_replies(tokenizer: Any) -> None:
    from grpo_plugins.config import GRPOConfig
    from grpo_plugins.episodes import build_environment

    tokenizer.chat_template = "{% if mood %}[{{ mood }}]{% endif %}" + tokenizer.chat_template
    config = GRPOConfig(
        environment={"name": "tool_calling", "params": {"tools_in": "template"}},
        chat_template_kwargs={"mood": "calm"}, max_completion_length=200,
    )
    generator = scripted_setup(ScriptedGenerator(Policy()), tokenizer, 200)
    env = build_environment(config, get_registry(), generator, tokenizer)
    prompts = [ROWS[0]["prompt"]]
    ids = env.encode_prompts(prompts, None, "error")
    assert tokenizer.decode(ids[0]).startswith("[calm]<|user|>")
    out = env.run(prompts, ids, {})
    # The reply is rendered with the same arguments (the template's prefix is not repeated).
    assert decode_where(tokenizer, out.completion_ids[0], out.completion_mask[0] - out.model_mask[0]) == TOOL_REPLY.format(result=56088)
    env.close()


def test_dynamic_sampling_that_drops_groups_refuses_a_multi_turn_environment(engine_factory) -> None:
    from grpo_plugins.errors import TrainingError

    engine = engine_factory(group_filter="drop_zero_std")
    with pytest.raises(TrainingError, match="group_filter that drops groups .* multi-turn environment"):
        engine.rollouts.make(0, 1)


# -- evaluation runs the same episodes ------------------------------------------------------------


def test_eval_of_a_tool_calling_config_prompts_with_the_tools_and_runs_multi_turn_episodes(
    tiny_long: dict, tmp_path: Path, tokenizer: Any
) -> None:
    from grpo_plugins.config import load_config
    from grpo_plugins.evaluation import evaluate

    made: list[Scripted] = []

    class Recorded(Scripted):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    environment = {"name": "tool_calling", "params": {"tools_in": "system_prompt"}}
    config = load_config(_config(tiny_long, tmp_path, environment=environment, per_device_eval_batch_size=4))
    with registered_component("generator", Recorded, "scripted"):
        result = evaluate(config, base=True, eval_dataset=list(ROWS), registry=get_registry())
    calls = made[0].calls
    # The tools prompt opens every eval prompt, as in training.
    assert all(tokenizer.decode(p).startswith("<|system|>You can call these tools:") for call in calls for p in call)
    # Sampled (2 per prompt): first turns alternate tool call / wrong answer, and an episode that
    # called the calculator gets a second turn that answers with its result: rewards 1, 0, 1, 0.
    # Greedy: one episode per prompt, again a call (correct) then a wrong answer.
    assert [len(c) for c in calls] == [4, 2, 2, 1]  # sampled turn 1, turn 2; greedy turn 1, turn 2
    (correct,) = result.rewards
    assert correct.mean == 0.5 and correct.greedy == 0.5
    assert correct.pass_at == {1: 0.5, 2: 1.0}
