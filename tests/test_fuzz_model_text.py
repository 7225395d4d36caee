"""Model text never crashes a built-in reward or the tool-calling parser, nor makes it slow.

``hypothesis`` draws completions from what models really emit when training goes wrong: deep
nesting, long runs of one character, tags left open, lone surrogates and undecodable bytes, NUL
bytes, odd numbers. Each built-in must give a finite score (math_verify: or None), and
``ToolCalling.parse`` a call or an ``Error: ...`` message the conversation can carry.
Adversarial inputs of 256 KB must be read within 3 s of CPU time (a quadratic pattern takes
minutes on them). The linear patterns are checked against the plain, backtracking ones they
stand for on short texts, where the plain ones are fast.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import builtin_rewards
from builtin_environments import ToolCalling
from builtin_environments.tool_calling import MAX_NESTING, TOOL_CALL
from builtin_rewards import formats
from builtin_rewards._text import extract_answer
from builtin_rewards.code_execution import extract_code
from builtin_rewards.json_rewards import _FENCE as JSON_FENCE
from grpo_plugins.registry import Registry
from grpo_plugins.rewards import RewardRunner

FUZZ = settings(max_examples=150, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow], database=None)

#: Every built-in that reads model text without a model or a sandbox, as (name, params).
TEXT_REWARDS: list[tuple[str, dict[str, Any]]] = [
    ("correct_answer", {}),
    ("correct_answer", {"last_number": False}),
    ("exact_match", {"normalize": "squad"}),
    ("exact_match", {"normalize": "strip", "extract": "none"}),
    ("format", {}),
    ("regex_match", {}),
    ("regex_match", {"dotall": False, "ignore_case": True}),
    ("length", {"unit": "chars"}),
    ("length", {"unit": "words"}),
    ("overlong_punishment", {}),
    ("ngram_repetition", {"unit": "words"}),
    ("ngram_repetition", {"unit": "chars"}),
    ("json_valid", {}),
    ("json_valid", {"code_fence": False}),
    ("json_schema", {"schema": {"type": "array", "items": {"$ref": "#"}}, "valid_json_reward": 0.5}),
]


@pytest.fixture(scope="module")
def rewards() -> list[tuple[str, Any]]:
    registry = Registry()
    return [(name, registry.build("reward", name, params)) for name, params in TEXT_REWARDS]


def score_all(rewards: list[tuple[str, Any]], text: str, answer: str = "42") -> dict[str, Any]:
    """Each reward's score of ``text`` (plain and as a chat message), checked to be finite; by
    name, the first of a name's configurations."""
    out = {}
    for name, reward in rewards:
        for completion in (text, [{"role": "assistant", "content": text}]):
            values = reward(["q"], [completion], answer=[answer], completion_ids=[[1] * (len(text) % 300)])
            assert len(values) == 1 and isinstance(values[0], float) and math.isfinite(values[0]), (name, values)
            out.setdefault(name, values[0])
    return out


def check_tool_calls(turn: str) -> list[tuple[str, Any]]:
    """``ToolCalling.parse`` of ``turn``: each call a name and arguments that JSON-encode as
    UTF-8 (what the chat template and tokenizer need), or an ``Error: ...`` message."""
    calls = ToolCalling().parse(turn)
    assert len(calls) == len(TOOL_CALL.findall(turn))
    for name, arguments in calls:
        if name:
            assert isinstance(arguments, dict)
            json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False).encode("utf-8")
        else:
            assert isinstance(arguments, str) and arguments.startswith("Error: the tool call ")
    return calls


# -- strategies ----------------------------------------------------------------------------------

PIECES = [
    "<answer>", "</answer>", "<ANSWER>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "```", "```python\n", "```json\n", "\\boxed{", "{", "}", "[", "]", "(", ")", '"', ":", ",",
    "Answer:", "The final answer is", " is ", "=", "####", "*", "**", ".", " ", "  ", "\n", "\t", "\r",
    "\x00", "\u2003", "\ud800", "\udcff", "42", "-3.5", "1,000", "1e999999", "nan", "-inf", "1_000",
    "\u0661\u0662", "9" * 5000, '{"name": "calculator", "arguments": {"expression": "1+1"}}',
    '"\\ud800"', "\\ud83d\\ude00",
]

#: Characters of every kind, lone surrogates included (hypothesis leaves them out by default).
ANY_CHAR = st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF))


def any_text(max_size: int) -> st.SearchStrategy[str]:
    """Text of :data:`ANY_CHAR` (``st.text`` would drop the surrogates from such an alphabet)."""
    return st.lists(ANY_CHAR, max_size=max_size).map("".join)


#: Bytes a tokenizer could not decode, read back the way Python does with surrogateescape.
UNDECODABLE = st.binary(max_size=200).map(lambda b: b.decode("utf-8", "surrogateescape"))

MIXED = st.lists(st.one_of(st.sampled_from(PIECES), any_text(8), UNDECODABLE), max_size=40).map("".join)


@st.composite
def nested(draw: st.DrawFn) -> str:
    """Brackets nested 500-3000 levels deep (closed or not), inside a tag the parsers read."""
    depth = draw(st.integers(500, 3000))
    opening, closing = draw(st.sampled_from([("[", "]"), ("{", "}"), ("(", ")"), ('{"a":', "}"), ('{"name": "x", "arguments": ', "}")]))
    body = opening * depth + draw(st.sampled_from(["", "1", '"x"', "null"])) + closing * draw(st.sampled_from([depth, depth // 2, 0]))
    before, after = draw(st.sampled_from([
        ("", ""), ("<tool_call>", "</tool_call>"), ("<tool_call>", ""), ("<answer>", "</answer>"),
        ("\\boxed{", "}"), ("```json\n", "\n```"), ("Answer: ", ""), ("<think>", "</think><answer>1</answer>"),
    ]))
    return before + body + after


@st.composite
def repeated(draw: st.DrawFn) -> str:
    """One piece repeated into 1-64 KB, between two others (long runs that regexes backtrack over)."""
    piece = draw(st.sampled_from(PIECES + ["a b ", "\n\n", "<answer>x", "answer: ", "``` ", "<tool_call>x "]))
    times = draw(st.integers(1, 65536)) // max(1, len(piece))
    return draw(st.sampled_from(PIECES)) + piece * times + draw(st.sampled_from(PIECES))


NUMBERS = st.one_of(
    st.sampled_from(["1e999999", "-1e999999", "nan", "NaN", "inf", "-0", "0x1F", "1_000", "1/0", "3/4", ".5", "5.", "9" * 4301, "9" * 5000, "1" + "0" * 400]),
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.fractions().map(str),
    st.decimals(allow_nan=True, allow_infinity=True).map(str),
    st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=12),
)


# -- fuzzing ---------------------------------------------------------------------------------------


@FUZZ
@given(text=st.one_of(MIXED, nested(), repeated()))
def test_text_rewards_score_any_model_text(rewards: list[tuple[str, Any]], text: str) -> None:
    score_all(rewards, text)
    extract_code(text)


@FUZZ
@given(number=NUMBERS, reference=NUMBERS, wrapper=st.sampled_from(["{}", "<answer>{}</answer>", "\\boxed{{{}}}", "Answer: {}", "#### {}", "x = {}."]))
def test_answer_rewards_read_any_number(rewards: list[tuple[str, Any]], number: str, reference: str, wrapper: str) -> None:
    scores = score_all(rewards, wrapper.format(number), answer=reference)
    if number == reference and "x" not in wrapper and wrapper != "{}" and re.fullmatch(r"-?\d+", number) and len(number) <= 300:
        assert scores["correct_answer"] == 1.0 and scores["exact_match"] == 1.0


@FUZZ
@given(turn=st.one_of(MIXED, nested(), repeated()).map(lambda t: t if "<tool_call>" in t else "<tool_call>" + t))
def test_tool_call_parser_answers_any_turn(turn: str) -> None:
    check_tool_calls(turn)


@FUZZ
@given(arguments=st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(), st.integers(), any_text(5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(any_text(3), inner, max_size=3)),
    max_leaves=20,
))
def test_tool_call_arguments_are_passed_on_or_refused(arguments: Any) -> None:
    """Any JSON the model writes is either handed to the tool as written or refused with a
    message (lone surrogates; JSON encodes them as \\ud800 escapes)."""
    body = json.dumps({"name": "calculator", "arguments": {"x": arguments}})
    [(name, parsed)] = check_tool_calls(f"<tool_call>{body}</tool_call>")
    written = json.loads(body)["arguments"]  # JSON joins a high and a low surrogate into one character
    encodable = not re.search("[\ud800-\udfff]", json.dumps(written, ensure_ascii=False))
    assert (name == "calculator") == encodable
    if encodable:
        assert parsed == written or json.dumps(parsed) == json.dumps(written)  # NaN != NaN


@settings(max_examples=100, deadline=None, database=None)
@given(text=st.one_of(MIXED, NUMBERS.map("\\boxed{{{}}}".format)))
def test_math_verify_scores_any_model_text(text: str) -> None:
    reward = builtin_rewards.REWARDS["math_verify"](builtin_rewards.REWARDS["math_verify"].Params(timeout=1))
    assert reward(["q", "q"], [text, [{"role": "assistant", "content": text}]], answer=["1/2", "no number"]) in (
        [0.0, None],
        [1.0, None],
    )


# -- the linear patterns agree with the plain ones they stand for ---------------------------------

SHORT = st.lists(st.sampled_from(PIECES[:34] + ["x", "answer", "final answer", "-", "7"]), max_size=20).map("".join)
PLAIN_THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
PLAIN_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL | re.IGNORECASE)
PLAIN_NUM = r"-?\d[\d,]*(?:\.\d+)?"
PLAIN_FINAL_LINE = re.compile(
    rf"(?:(?:final answer|answer)\s*(?:is\s*:?|:|=)|^\s*####)\s*\**\s*{PLAIN_NUM}\s*\**[\s.]*$", re.IGNORECASE | re.MULTILINE
)
PLAIN_ANSWER_LINE = re.compile(r"(?:final answer|answer)\s*(?:is\s*:?|:|=)\s*\**\s*(.+?)\s*$|^\s*####\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


@settings(max_examples=400, deadline=None, database=None)
@given(text=SHORT)
def test_linear_patterns_agree_with_the_plain_ones(text: str) -> None:
    assert bool(re.search(formats.THINK_ANSWER, text, re.DOTALL)) == bool(PLAIN_THINK_ANSWER.search(text))
    assert bool(formats._FINAL_LINE.search(text)) == bool(PLAIN_FINAL_LINE.search(text))
    assert formats._has_tag(text) == bool(re.search(r"<answer>.*?</answer>", text, re.DOTALL | re.IGNORECASE))
    assert [b.strip() for b in TOOL_CALL.findall(text)] == re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL)
    assert [b.strip() for b in JSON_FENCE.findall(text)] == [
        b.strip() for b in re.findall(r"```(?:json)?\s*\n(.*?)```", text, re.DOTALL | re.IGNORECASE)
    ]
    tags = PLAIN_ANSWER_TAG.findall(text)
    if tags:
        assert extract_answer(text) == tags[-1]
    elif "\\boxed{" not in text:
        lines = [next(g for g in groups if g) for groups in PLAIN_ANSWER_LINE.findall(text)]
        # The plain pattern could also return an "answer" of only spaces or stars; those are gone.
        plain = lines[-1] if lines and lines[-1].strip(" *\t\r\n\u2003\x00") else None
        if plain is not None:
            assert extract_answer(text) == plain


# -- time: linear, not quadratic ----------------------------------------------------------------

N = 1 << 18  # 256 KB
ADVERSARIAL = {
    "unclosed answer tags": "<answer>" * (N // 8),
    "spaces inside an answer tag": "<answer>x" + " " * N + "x",
    "spaces after 'Answer:'": "Answer:" + " " * N + "x",
    "blank lines after 'Answer:'": "Answer:" + "\n" * N,
    "spaces after 'Answer: 1'": "Answer: 1" + " " * N + "x",
    "spaces after '####'": "####" + " " * N + "x",
    "many </think><answer> pairs": "<think>" + "</think><answer></answer>x" * (N // 26),
    "blank lines after a fence": "```" + "\n" * N,
    "spaces inside a tool call": "<tool_call>x" + " " * N + "x",
    "unclosed boxed": "\\boxed{" + "{" * N,
    "digits and commas": "1," * (N // 2),
    "words": "the a, b. " * (N // 10),
}


@pytest.mark.parametrize("label", sorted(ADVERSARIAL))
def test_adversarial_text_is_read_in_linear_time(rewards: list[tuple[str, Any]], label: str) -> None:
    text = ADVERSARIAL[label]
    start = time.thread_time()  # CPU time of this thread: the machine's load does not count
    score_all(rewards, text)
    check_tool_calls(text if "<tool_call>" in text else "<tool_call>" + text)
    extract_code(text)
    assert time.thread_time() - start < 3.0


# -- regressions: nested brackets, unencodable tool calls, unbounded math -------------------------

DEEP = "[" * 2000 + "]" * 2000


def test_2000_nested_brackets_in_a_tool_call_become_an_error_message() -> None:
    calls = check_tool_calls(f"<tool_call>{DEEP}</tool_call>")
    assert calls == [("", f"Error: the tool call is nested more than {MAX_NESTING} levels deep")]
    args = '{"name": "calculator", "arguments": {"expression": "1", "x": %s}}' % ("[" * 100 + "]" * 100)
    assert check_tool_calls(f"<tool_call>{args}</tool_call>")[0][0] == ""
    assert check_tool_calls('<tool_call>{"name": "calculator", "arguments": "' + "[" * 2000 + '"}</tool_call>')[0][0] == ""


def test_nested_brackets_are_not_valid_json_and_the_run_goes_on() -> None:
    spec = [{"name": "json_valid"}, {"name": "json_schema", "params": {"schema": {"type": "array", "items": {"$ref": "#"}}, "valid_json_reward": 0.5}}]
    completions = [DEEP, "```json\n" + DEEP + "\n```", "[[]]", "[" * 600 + "]" * 600]
    with RewardRunner(spec, Registry()) as runner:  # the engine's way: threads, checked values
        out = runner(["q"] * 4, completions, None, {})
    # 600 levels: JSON the json module reads, deeper than jsonschema's recursion reaches.
    assert out.tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.5]]


def test_a_tool_call_the_tokenizer_could_not_encode_is_refused(tmp_path: Any) -> None:
    """A \\ud800 escape in a call (the tokenizer would raise TypeError on it) and arguments
    nested 100 deep under a chat template that renders them (RecursionError) each become the
    tool's error message and count in env/tool_errors; the episode goes on."""
    from transformers import AutoTokenizer

    from grpo_plugins.kinds import EnvironmentSettings
    from grpo_plugins.registry import get_registry
    from grpo_plugins.testing import ScriptedGenerator, build_tiny_tokenizer, scripted_setup

    tokenizer = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp_path / "tok")))
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    turns = ['<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "calculator", "arguments": {"expression": %s}}</tool_call>' % ("[" * 100 + "]" * 100)]
    for turn in turns:
        env = ToolCalling(ToolCalling.Params(tools_in="template"))
        env.registry = get_registry()
        generator = scripted_setup(ScriptedGenerator(lambda p, turn=turn: "done" if "<|tool|>" in p else turn), tokenizer, 600)
        env.setup(generator, tokenizer, EnvironmentSettings(600, tokenizer.pad_token_id, [tokenizer.eos_token_id]))
        prompts = [[{"role": "user", "content": "hi"}]]
        out = env.run(prompts, env.encode_prompts(prompts, None, "error"), {})
        env.close()
        assert out.completions[0][1]["content"].startswith("Error: the tool call ")
        assert out.stats["tool_errors"] == [1.0] and out.stats["turns"] == [2.0]


@pytest.mark.parametrize(
    ("answer", "reference", "score"),
    [
        ("9007199254740993", "9007199254740992", 0.0),  # equal as floats
        ("9" * 5000, "9" * 4999 + "8", 0.0),  # both inf as floats
        ("9" * 5000, "9" * 5000 + ".0", 1.0),
        ("1e999999999999", "1E+999999999999", 1.0),
        ("1e-999999999999", "0", 1.0),  # within the tolerance
        ("0.3", "0.30000000000000004", 1.0),
        ("\u0661\u0662", "12", 1.0),  # Arabic-Indic digits
        ("sNaN", "12", 0.0),
        ("nan", "12", 0.0),
        ("-inf", "-Infinity", 1.0),
    ],
)
def test_correct_answer_compares_numbers_as_written(answer: str, reference: str, score: float) -> None:
    reward = builtin_rewards.REWARDS["correct_answer"]()
    assert reward(["q"], [f"<answer>{answer}</answer>"], answer=[reference]) == [score]


def test_reward_model_text_loses_only_its_lone_surrogates() -> None:
    from builtin_rewards._text import without_surrogates

    assert without_surrogates("a\ud800b\udcff") == "a\ufffdb\ufffd"
    assert without_surrogates("naïve 😀") == "naïve 😀"


@pytest.mark.timeout(120)
def test_math_verify_ends_on_an_answer_sympy_cannot_finish() -> None:
    """Off the main thread (where math-verify's signal-based limits do not work) the reward
    checks answers in its own worker process, within ``timeout``: 9^(9^(9^9)) and 2000 nested
    parentheses score 0.0 in seconds, a right answer in the same batch still 1.0."""
    reward = builtin_rewards.REWARDS["math_verify"](builtin_rewards.REWARDS["math_verify"].Params(timeout=1))
    result: dict[str, Any] = {}

    def call() -> None:
        completions = [r"\boxed{9^{9^{9^{9}}}}", r"so \boxed{\frac{1}{2}}", "\\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}", "\ud800\x00 1e999999"]
        result["scores"] = reward(["q"] * 4, completions, answer=["2", "0.5", "1", "2"])

    try:
        thread = threading.Thread(target=call)
        thread.start()
        thread.join(100)
        assert result.get("scores") == [0.0, 1.0, 0.0, 0.0]
    finally:
        reward.close()

