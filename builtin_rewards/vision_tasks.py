"""The built-in image task ``shapes``: count coloured shapes in a picture drawn locally with Pillow."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

INSTRUCTION = "Give the final answer as a number inside answer tags, like this: <answer>3</answer>"

#: The colours a picture may use (pure RGB values, so a picture's pixels name their shape's colour).
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 20),
    "purple": (140, 50, 170),
    "orange": (240, 130, 20),
    "black": (0, 0, 0),
}
BACKGROUND = (255, 255, 255)
Shape = Literal["circle", "square", "triangle", "diamond"]
Color = Literal["red", "green", "blue", "yellow", "purple", "orange", "black"]


@dataclass(frozen=True)
class Placed:
    """One shape of a picture: its kind, colour name, centre and half-width in pixels."""

    shape: str
    color: str
    x: int
    y: int
    radius: int


@dataclass(frozen=True)
class Scene:
    """What one row's picture shows and asks: the shapes, and the (colour, shape) asked about."""

    shapes: tuple[Placed, ...]
    color: str
    shape: str

    @property
    def answer(self) -> int:
        return sum(p.shape == self.shape and p.color == self.color for p in self.shapes)

    @property
    def question(self) -> str:
        return f"How many {self.color} {self.shape}s are in the image?"


class ShapesTask:
    """Pictures of simple coloured shapes with a counting question ("How many red circles are in
    the image?"), generated deterministically from a seed with Pillow (no download).

    Each row: ``prompt`` (one user message whose content is the image placeholder
    ``{"type": "image"}`` then the question and the answer format as text), ``image`` (a PIL
    image), ``question`` and ``answer`` (the count as text). The held-out split (``load_eval``)
    asks about colour-shape pairs that the training split never asks about (every colour and
    every shape is still asked about in training), so no held-out prompt is a training prompt.
    Default rewards: ``correct_answer`` (1.0) and ``format`` (0.5).
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        num_samples: int = Field(1000, ge=1, description="Number of pictures in the training split.")
        num_eval_samples: int = Field(100, ge=1, description="Pictures in the held-out split (load_eval).")
        image_size: int = Field(128, ge=32, le=1024, description="Width and height of the pictures in pixels.")
        min_count: int = Field(1, ge=0, description="Fewest shapes of the kind asked about.")
        max_count: int = Field(5, ge=1, le=30, description="Most shapes of the kind asked about.")
        max_distractors: int = Field(
            3, ge=0, le=30, description="Most other shapes (another colour or kind); each picture has 0 to this many."
        )
        shapes: list[Shape] = Field(
            default_factory=lambda: ["circle", "square", "triangle"], min_length=2, description="The kinds of shape drawn and asked about."
        )
        colors: list[Color] = Field(
            default_factory=lambda: ["red", "green", "blue", "yellow"], min_length=2, description="The colours drawn and asked about."
        )
        seed: int | None = Field(None, description="Seed of the generator; None: the run's seed.")
        instruction: str = Field(INSTRUCTION, description="Text after the question (states the answer format).")
        system_prompt: str | None = Field(None, description="A system message before the question; None: none.")

        @model_validator(mode="after")
        def _check(self) -> ShapesTask.Params:
            if self.max_count < self.min_count:
                raise ValueError("max_count must be >= min_count")
            if len(set(self.shapes)) != len(self.shapes) or len(set(self.colors)) != len(self.colors):
                raise ValueError("shapes and colors must not repeat an entry")
            cell = self.image_size // _grid(self)
            if cell < 12:
                raise ValueError(
                    f"image_size {self.image_size} is too small for {self.max_count + self.max_distractors} shapes "
                    "(each needs a 12x12 pixel cell); raise image_size or lower max_count/max_distractors"
                )
            return self

    default_rewards: ClassVar[list[str | dict[str, Any]]] = [
        "correct_answer",
        {"name": "format", "weight": 0.5},
    ]

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def pairs(self, held_out: bool) -> list[tuple[str, str]]:
        """The (colour, shape) pairs asked about in the training split, or in the held-out one.

        Held out: the diagonal ``(colors[i % C], shapes[i % S])`` for ``i < max(C, S)``, which
        leaves every colour and every shape in some training pair (C, S >= 2).
        """
        p = self.params
        n_c, n_s = len(p.colors), len(p.shapes)
        diagonal = {(p.colors[i % n_c], p.shapes[i % n_s]) for i in range(max(n_c, n_s))}
        every = [(c, s) for s in p.shapes for c in p.colors]
        return [pair for pair in every if (pair in diagonal) == held_out]

    def scene(self, rng: random.Random, pairs: list[tuple[str, str]]) -> Scene:
        """One picture's content drawn from ``rng``: the asked pair, its shapes, the distractors."""
        p = self.params
        color, shape = rng.choice(pairs)
        count = rng.randint(p.min_count, p.max_count)
        others = [(c, s) for s in p.shapes for c in p.colors if (c, s) != (color, shape)]
        kinds = [(color, shape)] * count + [rng.choice(others) for _ in range(rng.randint(0, p.max_distractors))]
        grid = _grid(p)
        cell = p.image_size // grid
        margin = (p.image_size - grid * cell) // 2
        placed = []
        for (c, s), index in zip(kinds, rng.sample(range(grid * grid), len(kinds))):
            radius = rng.randint(max(3, cell * 3 // 10), max(3, cell * 2 // 5))
            slack = cell // 2 - radius - max(1, cell // 10)  # a visible gap to the next cell's shape
            x = margin + (index % grid) * cell + cell // 2 + rng.randint(-slack, slack)
            y = margin + (index // grid) * cell + cell // 2 + rng.randint(-slack, slack)
            placed.append(Placed(s, c, x, y, radius))
        return Scene(tuple(placed), color, shape)

    def render(self, scene: Scene) -> Any:
        """The picture of ``scene`` as an RGB ``PIL.Image.Image`` (drawn without anti-aliasing, so
        every pixel is the background or one of :data:`COLORS`)."""
        from PIL import Image, ImageDraw

        size = self.params.image_size
        image = Image.new("RGB", (size, size), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for p in scene.shapes:
            fill, r = COLORS[p.color], p.radius
            if p.shape == "circle":
                draw.ellipse((p.x - r, p.y - r, p.x + r, p.y + r), fill=fill)
            elif p.shape == "square":
                draw.rectangle((p.x - r, p.y - r, p.x + r, p.y + r), fill=fill)
            elif p.shape == "triangle":
                draw.polygon([(p.x, p.y - r), (p.x + r, p.y + r), (p.x - r, p.y + r)], fill=fill)
            else:  # diamond
                draw.polygon([(p.x, p.y - r), (p.x + r, p.y), (p.x, p.y + r), (p.x - r, p.y)], fill=fill)
        return image

    def scenes(self, seed: int, held_out: bool = False) -> list[Scene]:
        """The content of the training pictures (or the held-out ones) for the run's ``seed``."""
        p = self.params
        base = p.seed if p.seed is not None else seed
        # A str seed is hashed with sha512: stable across processes and Python versions.
        rng = random.Random(f"shapes-eval/{base}") if held_out else random.Random(base)
        pairs = self.pairs(held_out)
        return [self.scene(rng, pairs) for _ in range(p.num_eval_samples if held_out else p.num_samples)]

    def rows(self, seed: int) -> list[dict[str, Any]]:
        """The training rows as plain dicts (what :meth:`load` turns into a Dataset)."""
        return [self._row(s) for s in self.scenes(seed)]

    def eval_rows(self, seed: int) -> list[dict[str, Any]]:
        """The held-out rows (what :meth:`load_eval` turns into a Dataset)."""
        return [self._row(s) for s in self.scenes(seed, held_out=True)]

    def _row(self, scene: Scene) -> dict[str, Any]:
        p = self.params
        text = f"{scene.question} {p.instruction}".strip()
        system = [{"role": "system", "content": [{"type": "text", "text": p.system_prompt}]}] if p.system_prompt else []
        return {
            "prompt": [*system, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
            "image": self.render(scene),
            "question": scene.question,
            "answer": str(scene.answer),
        }

    def load(self, seed: int) -> Any:
        """A ``datasets.Dataset`` with ``prompt``, ``image`` (an ``Image`` feature: PIL images when
        read), ``question`` and ``answer`` columns."""
        return _dataset(self.rows(seed))

    def load_eval(self, seed: int) -> Any:
        """The held-out split: same columns as :meth:`load`, colour-shape pairs training never asks."""
        return _dataset(self.eval_rows(seed))


def _grid(p: ShapesTask.Params) -> int:
    """Cells per side of the grid the shapes sit in (one shape per cell, so none overlap)."""
    return max(2, math.ceil(math.sqrt(p.max_count + p.max_distractors)))


def _dataset(rows: list[dict[str, Any]]) -> Any:
    from datasets import Dataset, Features, Image, Value

    features = Features(
        {
            "prompt": [{"role": Value("string"), "content": [{"type": Value("string"), "text": Value("string")}]}],
            "image": Image(),
            "question": Value("string"),
            "answer": Value("string"),
        }
    )
    return Dataset.from_list(rows, features=features)
