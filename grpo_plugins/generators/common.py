"""What every generation backend needs: the model under its wrappers, the EOS ids, cutting sampled
tokens at the first EOS, and seeding one generate call.

torch is imported inside functions: this package is imported when the registry loads plugins.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

#: Seeds of successive generate calls: ``seed * SEED_STRIDE + call``.
SEED_STRIDE = 1_000_003


def unwrap_model(model: Any) -> Any:
    """The model inside DDP / FSDP / accelerate wrappers (no copy of the weights)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_fp32_wrapper=True)


def base_model(model: Any) -> Any:
    """The transformers model under DDP/accelerate and peft wrappers (peft's injected LoRA layers
    stay in place, so calling its submodules applies the adapter)."""
    model = unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids of the tokenizer and of the model's generation config (e.g. Qwen has two)."""
    ids: list[int] = []
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    candidates.append(getattr(generation_config, "eos_token_id", None))
    for value in candidates:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return ids


def cut_at_eos(tokens: Tensor, is_eos: Tensor, pad_token_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Keep each row of sampled ``tokens`` (B, T') up to and including its first EOS.

    Args:
        tokens: (B, T') tokens as sampled (anything after a row's EOS is ignored).
        is_eos: (B, T') bool, True where the token ends a completion.
        pad_token_id: written after each row's end.

    Returns:
        completion_ids (B, T) right-padded, completion_mask (B, T) long with 1 up to and
        including the first EOS, is_truncated (B,) (no EOS), lengths (B,); T >= 1 is the
        longest kept completion.
    """
    import torch

    B, width = tokens.shape
    has_eos = is_eos.any(dim=1)  # (B,)
    lengths = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, width)  # (B,) EOS included
    T = max(int(lengths.max()), 1) if B else 1
    mask = (torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]).long()  # (B, T')
    ids = tokens.masked_fill(mask == 0, pad_token_id)
    if width < T:  # only when nothing was sampled at all
        pad = torch.full((B, T - width), pad_token_id, dtype=ids.dtype, device=ids.device)
        ids, mask = torch.cat([ids, pad], 1), torch.cat([mask, torch.zeros_like(pad)], 1)
    return ids[:, :T], mask[:, :T], ~has_eos, lengths


@contextmanager
def seeded_call(seed: int | None, call: int, device: Any) -> Iterator[None]:
    """Sample under the seed ``seed * SEED_STRIDE + call`` (when ``seed`` is set), leaving the
    global RNG state as it was; without a seed, sample from the global RNG."""
    import torch

    devices = [device] if getattr(device, "type", None) == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed * SEED_STRIDE + call)
        yield
