"""The run's prompts: their order (:class:`PromptStream`) and what a prompt index stands for
(:class:`PromptSource`: the dataset row, its prompt and its tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grpo_plugins.image_prompts import ImagePromptEncoder, MultimodalCache, row_images
from grpo_plugins.multimodal import MultimodalInputs


class PromptStream:
    """The run's prompt order: the dataset shuffled with a fresh seeded permutation per epoch.

    ``row(i)`` is the dataset row behind prompt index ``i`` (the index ``plan`` shows).
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self._epoch: int = -1
        self._perm: list[int] = []

    def row(self, index: int) -> int:
        epoch, pos = divmod(index, self.size)
        if not self.shuffle:  # shuffle_dataset: false
            return pos
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.size, generator=generator).tolist()
            self._epoch = epoch
        return self._perm[pos]


class PromptSource:
    """The prompts behind prompt-stream indices, encoded by the run's environment.

    Args:
        dataset: the prompts (a ``datasets.Dataset``) and any columns the rewards read.
        prompt_column: the column holding the prompt.
        environment: the set-up environment (its ``encode_prompts`` adds e.g. a tools prompt).
        stream: the run's prompt order.
        max_prompt_length: prompts are cut to this many tokens (None: kept whole).
        truncation: how (``prompt_truncation``).
        images: encodes prompts with their images (a vision-language model's run), else None:
            the prompts' ids then carry their image inputs, which :meth:`inputs` also gives by
            prompt index.
    """

    def __init__(
        self, dataset: Any, prompt_column: str, environment: Any, stream: PromptStream,
        max_prompt_length: int | None, truncation: str, images: ImagePromptEncoder | None = None,
    ) -> None:
        self.dataset, self.prompt_column, self.environment, self.stream = dataset, prompt_column, environment, stream
        self.max_prompt_length, self.truncation = max_prompt_length, truncation
        self.columns = [n for n in dataset.column_names if n != prompt_column]
        self.encoded: MultimodalCache | None = None
        if images is not None:
            encoder = images

            def encode(index: int) -> Any:
                row = self.dataset[self.stream.row(index)]
                where = f"prompt of row {self.stream.row(index)}"
                return encoder.encode(row[prompt_column], row_images(row, where), where)

            self.encoded = MultimodalCache(encode)

    def inputs(self, indices: Sequence[int]) -> list[MultimodalInputs | None]:
        """The image inputs of the prompts behind ``indices`` (None for a text run or index -1)."""
        if self.encoded is None:
            return [None] * len(indices)
        return self.encoded.inputs(indices)

    def prompts_for(self, indices: Sequence[int]) -> tuple[list[Any], list[list[int]], dict[str, list[Any]]]:
        """(prompts, their token ids, the other columns) behind ``indices``, one entry per index."""
        unique = sorted(set(indices))
        rows = {i: self.dataset[self.stream.row(i)] for i in unique}
        if self.encoded is not None:
            prompts = [rows[i][self.prompt_column] for i in indices]
            columns = {n: [rows[i][n] for i in indices] for n in self.columns}
            return prompts, [self.encoded(i) for i in indices], columns
        encoded = self.environment.encode_prompts(
            [rows[i][self.prompt_column] for i in unique], self.max_prompt_length, self.truncation
        )
        ids_of = dict(zip(unique, encoded))
        prompts = [rows[i][self.prompt_column] for i in indices]
        columns = {n: [rows[i][n] for i in indices] for n in self.columns}
        return prompts, [list(ids_of[i]) for i in indices], columns
