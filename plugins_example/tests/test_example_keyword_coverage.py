"""keyword_coverage: behaviour, params, and how the registry builds it."""

from __future__ import annotations

import pytest

from grpo_plugins.registry import ComponentParamsError, get_registry
from grpo_plugins_example.rewards import KeywordCoverage


def build(**params: object) -> KeywordCoverage:
    return get_registry().build("reward", "keyword_coverage", params)


def test_scores_the_fraction_of_keywords_mentioned() -> None:
    reward = build(keywords=["paris", "france"])
    completions = ["Paris is in France.", "It is Paris.", "No idea."]
    assert reward(prompts=["q"] * 3, completions=completions) == [1.0, 0.5, 0.0]


def test_is_case_sensitive_only_when_asked() -> None:
    reward = build(keywords=["Paris"], case_sensitive=True)
    assert reward(prompts=["q", "q"], completions=["Paris", "paris"]) == [1.0, 0.0]


def test_adds_per_sample_keywords_from_a_dataset_column() -> None:
    reward = build(keywords=["a"], column="must_mention")
    scores = reward(
        prompts=["q", "q"],
        completions=["a b", "a"],
        must_mention=[["b"], ["b", "c"]],
    )
    assert scores == [1.0, pytest.approx(1 / 3)]


def test_returns_none_for_a_sample_without_keywords() -> None:
    reward = build(column="must_mention")
    assert reward(prompts=["q", "q"], completions=["x", "x"], must_mention=[[], ["x"]]) == [None, 1.0]


def test_reads_conversational_completions() -> None:
    reward = build(keywords=["blue"])
    completions = [[{"role": "assistant", "content": "The sky is blue."}]]
    assert reward(prompts=[[{"role": "user", "content": "Colour?"}]], completions=completions) == [1.0]


def test_names_the_missing_column() -> None:
    reward = build(column="must_mention")
    with pytest.raises(ValueError, match="no column 'must_mention'"):
        reward(prompts=["q"], completions=["x"], answer=["1"])


def test_params_are_validated_by_the_registry() -> None:
    with pytest.raises(ComponentParamsError, match="case_sensitive"):
        build(case_sensitive="sometimes")
    with pytest.raises(ComponentParamsError, match="keyword"):
        build(keyword=["typo"])
