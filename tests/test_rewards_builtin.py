"""The built-in rewards: registration, params, and their scores on small explicit inputs."""

from __future__ import annotations

import sys

import pytest

from grpo_plugins.registry import ComponentParamsError, Registry
from grpo_plugins.rewards import RewardRunner
from grpo_plugins.testing import check_component

import builtin_rewards

ALL = sorted(builtin_rewards.REWARDS)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry()  # the installed entry points: the built-ins as a third party sees them


def build(registry: Registry, name: str, **params):
    return registry.build("reward", name, params)


def msgs(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_every_builtin_is_registered_through_the_entry_point(registry):
    for name in ALL:
        component = registry.get("reward", name)
        assert component.distribution == "grpo-plugins" and component.obj is builtin_rewards.REWARDS[name]
    assert registry.get("task", "arithmetic").distribution == "grpo-plugins"


def test_registration_imports_nothing_heavy():
    import subprocess

    code = (
        "import sys, builtin_rewards; "
        "print(sorted(m for m in ('torch','transformers','datasets','math_verify','jsonschema') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("name", "params", "sample"),
    [
        ("correct_answer", {}, {"answer": ["4", "4", "4"]}),
        ("exact_match", {}, {"answer": ["4", "4", "4"]}),
        ("math_verify", {}, {"answer": ["4", "4", "4"]}),
        ("format", {}, {}),
        ("regex_match", {"pattern": r"\d"}, {}),
        ("length", {"target": 5, "unit": "chars"}, {}),
        ("overlong_punishment", {"max_completion_length": 20, "overlong_buffer_length": 5}, {}),
        ("ngram_repetition", {}, {}),
        ("json_valid", {}, {}),
        ("json_schema", {"schema": {"type": "number"}}, {}),
        ("code_execution", {"timeout": 2}, {"tests": [["assert True"]] * 3}),
    ],
)
def test_builtin_meets_the_reward_contract(name, params, sample, request):
    if name == "code_execution":
        request.getfixturevalue("bwrap")  # the sandbox it needs
    check_component("reward", builtin_rewards.REWARDS[name], name=name, params=params, sample=sample)


def test_params_are_validated_with_their_path(registry):
    with pytest.raises(ComponentParamsError, match="normalize"):
        build(registry, "exact_match", normalize="weird")
    with pytest.raises(ComponentParamsError, match="not a valid regular expression"):
        build(registry, "regex_match", pattern="(unclosed")
    with pytest.raises(ComponentParamsError, match="overlong_buffer_length must not exceed"):
        build(registry, "overlong_punishment", max_completion_length=10, overlong_buffer_length=20)
    with pytest.raises(ComponentParamsError, match="exactly one of 'schema' and 'schema_column'"):
        build(registry, "json_schema")
    with pytest.raises(ComponentParamsError, match="did you mean 'target'"):
        build(registry, "length", tragret=3)


# -- answers ------------------------------------------------------------------------------------


def test_correct_answer_is_lenient_about_form(registry):
    r = build(registry, "correct_answer")
    completions = [
        "<answer>12</answer>",
        "Answer: 12.",
        "3 + 9 = 12",  # no marker: the last number
        "<answer> 12 </answer>.",
        "<answer>13</answer> oops 12",  # the tag wins over the last number
        r"so \boxed{12}",
        "twelve",
        "<answer>12.0</answer>",
        "So 3 + 9 = 12.\nThe answer is: 12",
        "3 + 9 = 12\n#### 12",  # GSM8K's marker
    ]
    assert r(["q"] * 10, completions, answer=["12"] * 10) == [1, 1, 1, 1, 0, 1, 0, 1, 1, 1]
    strict = build(registry, "correct_answer", last_number=False)
    assert strict(["q"], ["3 + 9 = 12"], answer=["12"]) == [0.0]
    assert r(["q"], [msgs("<answer>1,200</answer>")], answer=["1200"]) == [1.0]


def test_correct_answer_missing_column_is_explained(registry):
    with pytest.raises(KeyError, match="reads the dataset column 'answer'.*columns: solution.*'column' param"):
        build(registry, "correct_answer")(["q"], ["1"], solution=["1"])


@pytest.mark.parametrize(
    ("normalize", "expected"),
    [("none", [1, 0, 0, 0]), ("strip", [1, 1, 0, 0]), ("lower", [1, 1, 1, 0]), ("squad", [1, 1, 1, 1])],
)
def test_exact_match_normalisation(registry, normalize, expected):
    r = build(registry, "exact_match", normalize=normalize, extract="none")
    completions = ["Paris", " Paris. ", "PARIS", "the Paris!"]
    assert r(["q"] * 4, completions, answer=["Paris"] * 4) == expected


def test_exact_match_extracts_tagged_answer_and_reads_column(registry):
    r = build(registry, "exact_match", column="solution")
    assert r(["q", "q"], ["I think <answer>Paris</answer>", "Paris, surely"], solution=["Paris", "Paris"]) == [1.0, 0.0]


def test_math_verify_equivalence(registry):
    r = build(registry, "math_verify")
    completions = [r"so \boxed{\frac{1}{2}}", "The answer is 0.5", "<answer>1/2</answer>", "x = 3", msgs(r"$\boxed{0.5}$")]
    assert r(["q"] * 5, completions, answer=[r"\frac{1}{2}", "1/2", "0.5", "1/2", "1/2"]) == [1, 1, 1, 0, 1]


def test_math_verify_unparseable_reference_is_not_applicable(registry):
    r = build(registry, "math_verify")
    assert r(["q", "q"], ["42", r"\boxed{\sqrt{2}}"], answer=["no number here", r"\sqrt{2}"]) == [None, 1.0]


# -- formats ------------------------------------------------------------------------------------


def test_regex_match_default_is_think_answer(registry):
    r = build(registry, "regex_match")
    good = "<think>\nadd them\n</think>\n<answer>7</answer>"
    assert r(["q"] * 3, [good, "<answer>7</answer>", msgs(good)]) == [1.0, 0.0, 1.0]
    custom = build(registry, "regex_match", pattern=r"^\d+$", mode="fullmatch", match_reward=2.0, miss_reward=-1.0)
    assert custom(["q", "q"], ["42", "42!"]) == [2.0, -1.0]


def test_answer_format_full_and_partial_credit(registry):
    r = build(registry, "format")
    completions = [
        "3 plus 4 is 7. <answer>7</answer>",
        "<answer>7</answer>.",
        "<answer>7</answer> and then more text",
        "Answer: 7",
        "<answer>seven</answer>",
        "7",
        "3 + 4 = 7\nThe answer is: 7.",
        "#### 7",
    ]
    assert r(["q"] * 8, completions) == [1.0, 1.0, 0.5, 0.5, 0.5, 0.0, 0.5, 0.5]


# -- lengths ------------------------------------------------------------------------------------


def test_length_reward(registry):
    r = build(registry, "length", target=10)
    ids = [[0] * 10, [0] * 5, [0] * 15, [0] * 30, []]
    assert r(["q"] * 5, ["x"] * 5, completion_ids=ids) == [1.0, 0.5, 0.5, 0.0, 0.0]
    words = build(registry, "length", target=2, unit="words")
    assert words(["q"], ["one two three"]) == [0.5]


def test_overlong_punishment_follows_dapo(registry):
    # L_max = 20, L_cache = 5: no penalty up to 15 tokens, linear to -1 at 20, -1 beyond.
    r = build(registry, "overlong_punishment", max_completion_length=20, overlong_buffer_length=5)
    ids = [[0] * n for n in (0, 15, 16, 18, 20, 21)]
    assert r(["q"] * 6, [""] * 6, completion_ids=ids) == pytest.approx([0, 0, -0.2, -0.6, -1.0, -1.0])
    half = build(registry, "overlong_punishment", max_completion_length=20, overlong_buffer_length=5, penalty_factor=0.5)
    assert half(["q"], [""], completion_ids=[[0] * 18]) == pytest.approx([-0.3])


def test_the_former_name_repetition_penalty_says_it_was_renamed(registry):
    from grpo_plugins.registry import UnknownComponentError
    from grpo_plugins.validation import check_config

    with pytest.raises(UnknownComponentError, match="reward 'repetition_penalty' has been renamed to 'ngram_repetition'"):
        registry.get("reward", "repetition_penalty")
    problems = dict(check_config({"rewards": ["repetition_penalty"]}, registry).problems)
    assert "renamed to 'ngram_repetition'" in problems["rewards.0"]


def test_ngram_repetition(registry):
    r = build(registry, "ngram_repetition", ngram_size=2)
    # "a b a b a b": bigrams ab ba ab ba ab -> 2 distinct of 5 -> -(1 - 2/5)
    out = r(["q"] * 3, ["a b a b a b", "one two three four", "short"])
    assert out == pytest.approx([-0.6, 0.0, 0.0])
    tokens = build(registry, "ngram_repetition", ngram_size=1, unit="tokens", max_penalty=2.0)
    assert tokens(["q"], ["x"], completion_ids=[[5, 5, 5, 5]]) == pytest.approx([-1.5])


# -- JSON ---------------------------------------------------------------------------------------


def test_json_valid(registry):
    r = build(registry, "json_valid")
    completions = ['{"a": 1}', "```json\n[1, 2]\n```", "{'a': 1}", "plain text", msgs("null")]
    assert r(["q"] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_json_schema_fixed_and_per_sample(registry):
    schema = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
    r = build(registry, "json_schema", schema=schema, valid_json_reward=0.25)
    assert r(["q"] * 3, ['{"name": "x"}', '{"name": 3}', "nope"]) == [1.0, 0.25, 0.0]
    per_sample = build(registry, "json_schema", schema_column="schema")
    schemas = [{"type": "integer"}, '{"type": "string"}']
    assert per_sample(["q", "q"], ["3", "3"], schema=schemas) == [1.0, 0.0]


# -- through the runner -------------------------------------------------------------------------


def test_builtins_run_through_the_runner_by_name(registry):
    specs = [
        "correct_answer",
        {"name": "format", "weight": 0.5},
        {"name": "overlong_punishment", "params": {"max_completion_length": 4, "overlong_buffer_length": 2}},
    ]
    prompts = [[{"role": "user", "content": "1+1?"}]] * 2
    with RewardRunner(specs, registry) as runner:
        out = runner(prompts, ["<answer>2</answer>", "3"], [[1, 2], [1, 2, 3, 4, 5]], {"answer": ["2", "2"]})
    assert runner.names == ["correct_answer", "format", "overlong_punishment"]
    assert runner.weights == [1.0, 0.5, 1.0]
    assert out.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, -1.0]]
