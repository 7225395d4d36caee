"""JSON rewards: is the completion valid JSON, and does it match a JSON schema."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from builtin_rewards._text import completion_text

# Spaces, not newlines, before the fence's newline: "\s*\n" would make a long run of blank
# lines after an unclosed fence quadratic.
_FENCE = re.compile(r"```(?:json)?[^\S\n]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def parse_json(text: str, *, code_fence: bool) -> tuple[bool, Any]:
    """(ok, value): the completion (or, with ``code_fence``, the last fenced block) as JSON.

    Not JSON: text that does not parse, numbers of more than 4300 digits (Python's limit on
    converting text to an int) and JSON nested deeper than the json module reads (about 1000
    levels)."""
    if code_fence:
        blocks = _FENCE.findall(text)
        if blocks:
            text = blocks[-1]
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


class JsonValid:
    """1.0 when the completion is valid JSON (the last ```json fence if there is one), else 0.0."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        code_fence: bool = Field(True, description="Read the last ```json fenced block when present.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        return [float(parse_json(completion_text(c), code_fence=self.params.code_fence)[0]) for c in completions]


class JsonSchemaMatch:
    """1.0 when the completion is JSON that validates against a JSON schema (``jsonschema``);
    ``valid_json_reward`` when it is JSON but does not validate; 0.0 when it is not JSON.

    The schema is ``schema`` (one for all samples) or read per sample from ``schema_column``
    (a dict or a JSON string).
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        json_schema: dict[str, Any] | None = Field(None, alias="schema", description="One schema for all samples.")
        schema_column: str | None = Field(None, description="Dataset column with a schema per sample.")
        valid_json_reward: float = Field(0.0, description="Score of valid JSON that fails the schema.")
        code_fence: bool = True

        @model_validator(mode="after")
        def _one_source(self) -> JsonSchemaMatch.Params:
            if (self.json_schema is None) == (self.schema_column is None):
                raise ValueError("give exactly one of 'schema' and 'schema_column'")
            if self.json_schema is not None:
                from jsonschema.validators import validator_for

                validator_for(self.json_schema).check_schema(self.json_schema)
            return self

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params(schema={})

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        from jsonschema.validators import validator_for

        from builtin_rewards._text import column

        p = self.params
        n = len(completions)
        schemas = [p.json_schema] * n if p.json_schema is not None else column(kwargs, p.schema_column or "", "json_schema", n)
        out = []
        for c, schema in zip(completions, schemas):
            if isinstance(schema, str):
                schema = json.loads(schema)
            ok, value = parse_json(completion_text(c), code_fence=p.code_fence)
            if not ok:
                out.append(0.0)
                continue
            try:
                valid = validator_for(schema)(schema).is_valid(value)
            except RecursionError:  # a recursive schema ("$ref": "#") on deeply nested JSON
                valid = False
            out.append(1.0 if valid else p.valid_json_reward)
        return out
