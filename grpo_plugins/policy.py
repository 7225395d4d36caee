"""The model being trained as the rollout and the micro-steps see it (:class:`Policy`), the
padding both trim off before a forward (:func:`trim_padding`), and how a micro-batch's forwards
are split into passes (:func:`plan_passes`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from grpo_plugins.config import GRPOConfig
    from grpo_plugins.multimodal import MultimodalInputs


@dataclass
class Policy:
    """The model being trained, as the rollout and the micro-steps see it.

    Attributes:
        model: the accelerate-prepared model (DDP-wrapped on several processes).
        unwrapped: the same model without wrappers.
        ref_model: a frozen copy for the KL term (full fine-tuning with ``beta != 0``), else None.
        is_peft: a peft model: with ``beta != 0`` its reference is the adapter disabled.
        layers: a context manager factory under which forwards run (compiled layers, if any).
        chunk_fn: the compiled log-softmax chunk, or None.
        multiple: sequences are left-padded to a multiple of this (8 with compiled layers; see
            :func:`trim_padding`).
        images: prompt indices -> their image inputs (a vision-language model's run), else None.
        min_pass_tokens: the tokens below which a forward+backward pass costs no less
            (:func:`host_bound_tokens`); the pass planner does not split below it.
        max_pass_tokens: the most tokens (rows x padded length) one pass may hold
            (``train_pass_tokens``), or None; see :meth:`pass_tokens`.
        pass_budget: sizes that number on first use instead (``train_pass_tokens: auto``;
            :class:`~grpo_plugins.pass_budget.PassBudget`), or None.
    """

    model: Any
    unwrapped: Any
    ref_model: Any
    is_peft: bool
    layers: Callable[[], AbstractContextManager[None]]
    chunk_fn: Callable[..., Any] | None
    multiple: int = 1
    images: Callable[[Sequence[int]], list[MultimodalInputs | None]] | None = None
    min_pass_tokens: int = 0
    max_pass_tokens: int | None = None
    pass_budget: Callable[[], int | None] | None = None

    def pass_tokens(self) -> int | None:
        """The most tokens one pass may hold (the same number for the whole run), or None."""
        if self.pass_budget is not None:
            self.pin_pass_tokens(self.pass_budget())
        return self.max_pass_tokens

    @property
    def pass_tokens_known(self) -> bool:
        """Whether :meth:`pass_tokens` is settled (no budget left to size)."""
        return self.pass_budget is None

    def pin_pass_tokens(self, tokens: int | None) -> None:
        """Settle :meth:`pass_tokens` at ``tokens`` (e.g. the number a resumed run had sized)."""
        self.max_pass_tokens, self.pass_budget = tokens, None

    def image_inputs(self, prompt_index: Sequence[int], ids: Tensor, t: int) -> dict[str, Tensor]:
        """The image inputs of a pass over rows of prompts ``prompt_index`` (``ids`` (B, P+t));
        empty for a text run."""
        if self.images is None:
            return {}
        from grpo_plugins.multimodal import collate

        dtype = next((p.dtype for p in self.unwrapped.parameters() if p.is_floating_point()), None)
        return collate(self.images(prompt_index), ids, ids.shape[1] - t, dtype)


#: Host time to launch one decoder layer's forward + backward kernels (compiled layers), and the
#: bf16 rate a large pass runs at: measured on an H200, a 16-row pass of a 24-layer 0.4B model
#: took 0.25 s, nearly what the whole 64-row micro-batch took.
HOST_SECONDS_PER_LAYER = 0.01
PASS_FLOPS_PER_SECOND = 4e14


def host_bound_tokens(model: Any, device: torch.device) -> int:
    """The tokens a forward+backward pass of ``model`` must hold before the GPU, not the host
    launching its kernels, sets its time: layers x host seconds per layer / (6 x parameters /
    the GPU's rate). About 150k tokens for a 135M model (never worth a second pass), 30k at
    0.5B, 2.5k at 7B. 0 off CUDA, where kernels run as they are launched."""
    if device.type != "cuda":
        return 0
    from grpo_plugins.compiled_layers import decoder_layers

    layers = len(decoder_layers(model) or []) or 1
    params = sum(p.numel() for p in model.parameters())
    return int(layers * HOST_SECONDS_PER_LAYER * PASS_FLOPS_PER_SECOND / (6 * max(params, 1)))


def trim_padding(
    input_ids: Tensor, attention_mask: Tensor, T: int, multiple: int = 1, min_t: int = 1
) -> tuple[Tensor, Tensor, int]:
    """Drop prompt columns that are padding in every row and completion columns past the longest
    completion; returns (ids, mask, kept completion length t >= min_t).

    ``multiple``: keep (or add) left padding so the length is a multiple of it. Compiled layers
    use 8: SDPA's fused kernels need the mask's rows 16-byte aligned, and torch.compile guards on
    that divisibility, so lengths that break it would compile a second graph."""
    P = input_ids.shape[1] - T
    comp = attention_mask[:, P:]  # (B, T)
    t = min(T, max(min_t, int(comp.sum(1).max()) if comp.numel() else 1))
    prompt_any = attention_mask[:, :P].any(0)  # (P,)
    first = int(prompt_any.float().argmax()) if bool(prompt_any.any()) else P
    ids, mask = _trim_to(input_ids, attention_mask, T, multiple, t, first)
    return ids, mask, t


def _trim_to(input_ids: Tensor, attention_mask: Tensor, T: int, multiple: int, t: int, first: int) -> tuple[Tensor, Tensor]:
    """:func:`trim_padding`'s cut, given the completion columns to keep and the first prompt
    column any row attends (host integers: no synchronisation with the device)."""
    P = input_ids.shape[1] - T
    first = min(first, max(P - 1, 0))
    end = P + t
    extra = -(end - first) % multiple
    reuse = min(extra, first)  # padding columns that are already there
    ids, mask = input_ids[:, first - reuse : end], attention_mask[:, first - reuse : end]
    if extra > reuse:
        pad = extra - reuse
        ids = torch.cat([ids.new_zeros(ids.shape[0], pad), ids], dim=1)
        mask = torch.cat([mask.new_zeros(mask.shape[0], pad), mask], dim=1)
    return ids, mask


@dataclass(frozen=True)
class RowLayout:
    """Where each row's tokens sit, read from the device once per micro-batch so that cutting
    its passes needs no further synchronisation (one per pass would drain the GPU's queue
    before every forward).

    Attributes:
        prompt: attended prompt tokens per row.
        completion: attended completion tokens per row.
        prompt_start: the first attended prompt column per row (P when it has none).
        one_run: the row's tokens are one contiguous run that starts in its prompt, so moving
            them to the row's start needs no padding mask (:func:`~grpo_plugins.logprobs.left_aligned`).
    """

    prompt: list[int]
    completion: list[int]
    prompt_start: list[int]
    one_run: list[bool]

    @classmethod
    def of(cls, attention_mask: Tensor, T: int) -> RowLayout:
        att = attention_mask.bool()
        B, L = att.shape
        P = L - T
        prompt, completion = att[:, :P].sum(1), att[:, P:].sum(1)
        start = att[:, :P].int().argmax(1) if P > 0 else torch.zeros(B, dtype=torch.long, device=att.device)
        start = torch.where(prompt > 0, start, P)
        first = att.int().argmax(1)
        last = L - 1 - att.flip(1).int().argmax(1)
        one_run = (last - first + 1 == att.sum(1)) & (prompt > 0)
        rows = torch.stack([prompt, completion, start, one_run.long()]).tolist() if B else [[], [], [], []]
        return cls(rows[0], rows[1], rows[2], [bool(v) for v in rows[3]])

    def reordered(self, order: list[int]) -> RowLayout:
        return RowLayout(*([values[i] for i in order] for values in (self.prompt, self.completion, self.prompt_start, self.one_run)))


@dataclass(frozen=True)
class MicroBatchPasses:
    """How the forwards of one micro-batch run: its rows, trimmed together, in the order of the
    passes (longest first when ``group_by_length`` splits them), and each pass's rows.

    The training step and the old/reference log-prob passes use the same plan, so every row sees
    the same input (the same neighbours and padding) in both, and their log-probs agree exactly.

    Attributes:
        ids: (B, P'+t) the micro-batch's token ids, in pass order.
        attention_mask: (B, P'+t), in pass order.
        t: completion columns kept for the micro-batch.
        order: (B,) the micro-batch row each pass-order row comes from, or None (unchanged).
        chunks: consecutive slices of the pass order, one per forward.
        layout: where each pass-order row's tokens sit (read once; the passes are cut from it).
        order_list: ``order`` on the host, or None.
    """

    ids: Tensor
    attention_mask: Tensor
    t: int
    order: Tensor | None
    chunks: list[slice]
    layout: RowLayout
    order_list: list[int] | None = None

    def pass_inputs(self, chunk: slice, multiple: int) -> tuple[Tensor, Tensor, int]:
        """(ids, attention_mask, completion width) of one pass: with several passes, each cut to
        its own longest prompt and completion (at least two completion columns when ``t`` has),
        as :func:`trim_padding` cuts, from the row layout (no synchronisation)."""
        if len(self.chunks) == 1:
            return self.ids, self.attention_mask, self.t
        P = self.ids.shape[1] - self.t
        rows = range(len(self.layout.completion))[chunk]
        longest = max((self.layout.completion[i] for i in rows), default=0) if self.t else 1
        t = min(self.t, max(min(2, self.t), longest))
        first = min((self.layout.prompt_start[i] for i in rows), default=P)
        ids, mask = _trim_to(self.ids[chunk], self.attention_mask[chunk], self.t, multiple, t, first)
        return ids, mask, t

    def one_run(self, chunk: slice) -> bool:
        """Whether every row of the pass is one contiguous run of tokens from its prompt on."""
        return all(self.layout.one_run[chunk])

    def rows_of(self, values: Sequence[Any], chunk: slice) -> list[Any]:
        """The entries of ``values`` (one per micro-batch row) that one pass's rows hold."""
        ordered = list(values) if self.order_list is None else [values[i] for i in self.order_list]
        return ordered[chunk]

    def in_pass_order(self, x: Tensor) -> Tensor:
        """``x`` (B, ...) of the micro-batch's rows, reordered as the passes see them."""
        return x if self.order is None else x[self.order]


def plan_passes(
    input_ids: Tensor,
    attention_mask: Tensor,
    T: int,
    multiple: int,
    chunk_rows: int | None,
    split: bool,
    min_pass_tokens: int = 0,
    max_pass_tokens: int | None = None,
) -> MicroBatchPasses:
    """The :class:`MicroBatchPasses` of one micro-batch (``input_ids`` (B, P+T) with T completion
    columns): ``chunk_rows`` rows and ``max_pass_tokens`` padded tokens a pass at most, split by
    length when ``split`` (no pass costed below ``min_pass_tokens``)."""
    from grpo_plugins.row_chunks import length_chunks

    ids, att, t = trim_padding(input_ids, attention_mask, T, multiple)  # (B, P'+t)
    layout = RowLayout.of(att, t)
    order, chunks = length_chunks(
        layout.prompt, layout.completion, chunk_rows, split=split,
        min_pass_tokens=min_pass_tokens, max_pass_tokens=max_pass_tokens,
    )
    if order == sorted(order):
        return MicroBatchPasses(ids, att, t, None, chunks, layout)
    rows = torch.as_tensor(order).to(ids.device, non_blocking=True)  # not waiting for the device's queue
    return MicroBatchPasses(ids[rows], att[rows], t, rows, chunks, layout.reordered(order), list(order))


def groups_by_length(config: GRPOConfig) -> bool:
    """Whether a micro-batch's rows are split into passes by length (``group_by_length``): not
    with ``top_entropy_quantile < 1``, whose quantile is taken over the rows of one pass, nor
    under FSDP, whose processes gather each layer together and so must make the same passes."""
    return config.group_by_length and config.top_entropy_quantile >= 1.0 and config.fsdp is None
