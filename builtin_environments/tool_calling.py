"""The ``tool_calling`` environment: the model calls tools, reads their results, continues.

A tool call is written in the tag format of Hermes / Qwen2.5 chat templates::

    <tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>

Every call of a turn is run (concurrently, each under ``tool_timeout``); each result becomes a
``{"role": "tool", "name": ..., "content": ...}`` message rendered by the chat template, and the
model is prompted again. A turn without a tool call ends the episode.
"""

from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from grpo_plugins.episodes import Episode, TurnBasedEnvironment
from grpo_plugins.errors import GRPOPluginsError

if TYPE_CHECKING:  # imported when used: `grpo-plugins validate` must start fast
    import concurrent.futures as cf

#: A tool call's body (surrounding whitespace is stripped after the match: "\s*" on both sides
#: of a lazy group would make a long run of spaces inside a call quadratic).
TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

#: How deeply a tool call's JSON may nest.
MAX_NESTING = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


def _parse_call(body: str) -> tuple[str, Any]:
    """(name, arguments) of one tool call's body, or ("", the error message for the model)."""
    try:
        call = json.loads(body)
        name, arguments = call["name"], call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise ValueError("'name' must be a string and 'arguments' an object")
    except (ValueError, KeyError, TypeError) as exc:
        return "", f"Error: the tool call is not valid JSON with 'name' and 'arguments' ({exc})"
    except RecursionError:  # the json module's own limit, far deeper than MAX_NESTING
        return "", f"Error: the tool call is nested more than {MAX_NESTING} levels deep"
    problem = _unrenderable(call)
    if problem is not None:
        return "", f"Error: the tool call {problem}"
    return name, arguments


def _unrenderable(value: Any) -> str | None:
    """Why a parsed tool call cannot go into the conversation, or None: nested more than
    :data:`MAX_NESTING` levels (the chat template renders it recursively), or a string with a
    lone surrogate (a ``\\ud800`` escape), which no tokenizer encodes."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return "has a lone surrogate escape (such as \\ud800) in a string"
        elif isinstance(item, (dict, list)):
            if depth > MAX_NESTING:
                return f"is nested more than {MAX_NESTING} levels deep"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return None


TOOLS_PROMPT = (
    "You can call these tools:\n{tools}\n"
    'To call a tool, write <tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call> '
    "and stop; the result comes back in the next message."
)


class ToolCallingParams(BaseModel):
    """Parameters of the ``tool_calling`` environment."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        description="Registered tool names (kind 'tool'): calculator, python, or a plugin's.",
    )
    max_tool_calling_iterations: int | None = Field(
        5, ge=0, description="Most rounds of tool calls per episode (TRL's name); then the episode ends. None: only max_completion_length bounds them."
    )
    tool_timeout: float = Field(10.0, gt=0, description="Seconds a tool call may take; then its message is a timeout error.")
    max_tool_response_chars: int = Field(2000, ge=1, description="A tool's message is cut to this many characters.")
    tools_in: Literal["auto", "template", "system_prompt"] = Field(
        "auto",
        description="Where the model is shown the tools: the chat template's tools= (template), a system message (system_prompt), or auto: the template when it renders tools, else the system message.",
    )
    tools_prompt: str = Field(TOOLS_PROMPT, description="The system-message text with {tools}: one JSON schema per line.")
    max_workers: int = Field(8, ge=1, description="Tool calls run at once.")

    @field_validator("tools")
    @classmethod
    def _registered(cls, names: list[str]) -> list[str]:
        """Unknown tool names fail when the config is validated, before any model is loaded."""
        from grpo_plugins.registry import get_registry

        registry = get_registry()
        for name in names:
            try:
                registry.get("tool", name)
            except GRPOPluginsError as exc:
                raise ValueError(str(exc)) from None
        return names


class ToolCalling(TurnBasedEnvironment):
    """Multi-turn episodes with tool calls (TRL's ``tools`` / ``max_tool_calling_iterations``).

    Tools are plain functions with type hints and a docstring, named in ``params.tools`` (kind
    ``tool``) or given as ``functions`` when built in Python. Tool errors and timeouts become the
    tool's message (``Error: ...``), never a crash. Rewards get the whole conversation as the
    completion (assistant turns with their ``tool_calls``, tool messages) and the columns
    ``num_tool_calls`` and ``num_tool_errors``.
    """

    Params = ToolCallingParams

    def __init__(self, params: ToolCallingParams | None = None, functions: list[Callable[..., Any]] | None = None) -> None:
        self.params = params or ToolCallingParams()
        p = self.params
        self.max_turns = None if p.max_tool_calling_iterations is None else p.max_tool_calling_iterations + 1
        self.functions: dict[str, Callable[..., Any]] = {fn.__name__: fn for fn in functions or []}
        self.schemas: list[dict[str, Any]] = []
        self._pool: cf.ThreadPoolExecutor | None = None
        self._in_template = False

    # -- setup ----------------------------------------------------------------------------------

    def setup(self, generator: Any, tokenizer: Any, settings: Any) -> None:
        from transformers.utils import get_json_schema

        super().setup(generator, tokenizer, settings)
        if self.registry is not None:
            for name in self.params.tools:
                if name not in self.functions:
                    self.functions[name] = self.registry.build("tool", name, {})
        elif set(self.params.tools) - set(self.functions):
            raise GRPOPluginsError("environment 'tool_calling': tools named in params need the run's registry")
        if not self.functions:
            raise GRPOPluginsError("environment 'tool_calling' has no tools: list some under environment.params.tools")
        self.schemas = []
        for name, fn in self.functions.items():
            try:
                schema = get_json_schema(fn)
            except Exception as exc:  # transformers raises its own DocstringParsingException / TypeHintParsingException
                raise GRPOPluginsError(
                    f"tool '{name}' cannot be described to the model: {exc}. A tool needs type hints on every "
                    "argument and a docstring with an Args: section (TRL's convention)"
                ) from exc
            schema["function"]["name"] = name
            self.schemas.append(schema)
        self._in_template = self._template_renders_tools() if self.params.tools_in == "auto" else self.params.tools_in == "template"
        import concurrent.futures as cf

        self._pool = cf.ThreadPoolExecutor(self.params.max_workers, thread_name_prefix="grpo-tool")

    def _template_renders_tools(self) -> bool:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            return False
        probe = [{"role": "user", "content": "."}]
        try:
            plain = self.tokenizer.apply_chat_template(probe, tokenize=False)
            with_tools = self.tokenizer.apply_chat_template(probe, tokenize=False, tools=self.schemas)
        except Exception:
            return False
        return plain != with_tools

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- prompts ----------------------------------------------------------------------------------

    def chat_template_kwargs(self) -> dict[str, Any]:
        return {"tools": self.schemas} if self._in_template else {}

    def tools_text(self) -> str:
        """The tools as the system message shows them."""
        lines = "\n".join(json.dumps(s["function"]) for s in self.schemas)
        return self.params.tools_prompt.format(tools=lines)

    def with_tools(self, prompt: Any) -> Any:
        """The prompt with the tools described in it (when the template does not render them)."""
        if self._in_template:
            return prompt
        text = self.tools_text()
        if isinstance(prompt, str):
            return f"{text}\n\n{prompt}"
        messages = [dict(m) for m in prompt]
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        else:
            messages.insert(0, {"role": "system", "content": text})
        return messages

    def encode_prompts(self, prompts: list[Any], max_prompt_length: int | None, truncation: str) -> list[list[int]]:
        return super().encode_prompts([self.with_tools(p) for p in prompts], max_prompt_length, truncation)

    # -- turns ------------------------------------------------------------------------------------

    def start(self, episode: Episode) -> None:
        episode.stats.update(tool_calls=0.0, tool_errors=0.0)
        episode.info.update(num_tool_calls=0, num_tool_errors=0)

    def parse(self, turn: str) -> list[tuple[str, Any]]:
        """The (name, arguments) of each tool call in ``turn``; unparsable calls give
        ("", error message). Never raises, whatever the model wrote."""
        return [_parse_call(body.strip()) for body in TOOL_CALL.findall(turn)]

    def respond_batch(self, episodes: list[Episode], turns: list[str]) -> list[list[dict[str, Any]] | None]:
        assert self._pool is not None, "setup() was not called"
        parsed = [self.parse(t) for t in turns]
        futures = [[self._submit(name, args) for name, args in calls] for calls in parsed]
        deadline = time.monotonic() + self.params.tool_timeout  # the round's calls run concurrently
        replies: list[list[dict[str, Any]] | None] = []
        for episode, calls, pending in zip(episodes, parsed, futures):
            if not calls:
                replies.append(None)
                continue
            episode.messages[-1]["tool_calls"] = [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls if n
            ]
            messages = []
            for (name, _), future in zip(calls, pending):
                content, failed = self._result(name, future, deadline)
                episode.stats["tool_calls"] += 1
                episode.info["num_tool_calls"] += 1
                if failed:
                    episode.stats["tool_errors"] += 1
                    episode.info["num_tool_errors"] += 1
                messages.append({"role": "tool", "name": name or "invalid", "content": content})
            replies.append(messages)
        return replies

    def respond(self, episode: Episode, turn: str) -> list[dict[str, Any]] | None:
        return self.respond_batch([episode], [turn])[0]

    def _submit(self, name: str, arguments: Any) -> cf.Future[Any] | str:
        if not name:
            return str(arguments)  # the parse error
        fn = self.functions.get(name)
        if fn is None:
            return f"Error: unknown tool '{name}'; the tools are: {', '.join(self.functions)}"
        assert self._pool is not None
        try:
            if inspect.iscoroutinefunction(fn):  # async tools, as TRL allows
                import asyncio

                return self._pool.submit(lambda: asyncio.run(fn(**arguments)))
            return self._pool.submit(fn, **arguments)
        except RuntimeError as exc:  # "can't start new thread": the host is short of tasks; the episode goes on
            return f"Error: tool '{name}' could not be started ({exc})"

    def _result(self, name: str, future: cf.Future[Any] | str, deadline: float) -> tuple[str, bool]:
        """The tool message's text, and whether the call failed."""
        import concurrent.futures as cf

        if isinstance(future, str):
            return future, True
        try:
            value = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            future.cancel()
            return f"Error: tool '{name}' timed out after {self.params.tool_timeout:g} seconds", True
        except Exception as exc:  # a tool's own error is the model's to read, never a crash
            return f"Error: {type(exc).__name__}: {exc}", True
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        limit = self.params.max_tool_response_chars
        return (text if len(text) <= limit else text[:limit] + " ...(cut)"), False
