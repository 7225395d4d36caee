"""An example environment: ``second_chance`` -- a teacher who says when an answer is wrong.

A multi-turn rollout in a few lines: :class:`~grpo_plugins.episodes.TurnBasedEnvironment`
samples the turns of the whole batch together and keeps the loss on the model's own tokens; this
class only decides what the environment answers after each turn.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from grpo_plugins import hookimpl
from grpo_plugins.episodes import Episode, TurnBasedEnvironment

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class SecondChance(TurnBasedEnvironment):
    """When the model's ``<answer>`` differs from the dataset's answer, a user message says so
    and the model tries again, up to ``max_attempts`` answers. Rewards get the whole
    conversation (``correct_answer`` reads its last answer) and the column ``attempts``."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("answer", description="Dataset column holding the right answer.")
        max_attempts: int = Field(2, ge=1, description="Answers the model may give.")
        feedback: str = Field("That is not right. Try again.", description="What the teacher says after a wrong answer.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def start(self, episode: Episode) -> None:
        episode.info["attempts"] = 0
        episode.stats["wrong_answers"] = 0.0

    def respond(self, episode: Episode, turn: str) -> list[dict[str, Any]] | None:
        episode.info["attempts"] += 1
        found = ANSWER.findall(turn)
        if found and found[-1].strip() == str(episode.row.get(self.params.column, "")).strip():
            return None  # right: the episode ends
        episode.stats["wrong_answers"] += 1
        if episode.info["attempts"] >= self.params.max_attempts:
            return None  # no tries left
        return [{"role": "user", "content": self.params.feedback}]


@hookimpl
def register_environments(register):
    register(SecondChance, name="second_chance")
