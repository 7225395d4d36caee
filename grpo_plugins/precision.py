"""float32 master weights for trainable parameters stored in 16 bits.

An AdamW update at a small learning rate is far below half a bfloat16 ulp of the weight it
changes (bf16 keeps 8 significant bits: a weight of 0.5 moves only in steps of 2**-9 ~ 0.002,
while lr 1e-6 moves it by about 1e-6 per step), so stepping AdamW on bf16 weights rounds almost
every update away and the model does not learn. The cure used by mixed-precision training
everywhere: the optimizer owns float32 copies of those weights (and float32 moments), steps
them, and writes the rounded result back into the 16-bit weights that the forward pass, the
generator and the checkpoints use. The rounding error then stays in the float32 copy instead
of being thrown away, so many small updates add up.

Cost: 4 bytes per trainable 16-bit parameter for the copy, plus float32 instead of 16-bit AdamW
moments (4 more bytes per parameter), and one copy of the weights per optimizer step. LoRA
adapters are float32 by default (peft keeps them so) and are their own masters; with
``lora.dtype: model`` they are 16-bit and get master copies like full fine-tuning's weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["MasterWeights", "needs_master_weights"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def needs_master_weights(params: Sequence[Tensor]) -> bool:
    """Whether any of ``params`` is stored in 16 bits."""
    return any(p.dtype in _LOW_PRECISION for p in params)


class MasterWeights:
    """The optimizer's float32 view of a list of trainable parameters.

    Build the optimizer over :attr:`params` instead of the model's parameters; after the
    backward passes call :meth:`grads_to_masters` (then clip and step as usual), and after the
    optimizer step :meth:`masters_to_params`. Parameters that are already float32 are their own
    master (no copy).

    Args:
        params: the model's trainable parameters.
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.model_params: list[Tensor] = list(params)
        self.params: list[Tensor] = [
            p.detach().float().clone() if p.dtype in _LOW_PRECISION else p for p in self.model_params
        ]
        self._copied = [m is not p for p, m in zip(self.model_params, self.params)]

    def _pairs(self) -> Iterator[tuple[Tensor, Tensor]]:
        for p, m, copied in zip(self.model_params, self.params, self._copied):
            if copied:
                yield p, m

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """Move the 16-bit gradients into float32 master gradients (the 16-bit ones are freed)."""
        for p, m in self._pairs():
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """Write the stepped master weights, rounded, into the model's parameters (in place, so
        captured CUDA graphs and the generator see them)."""
        for p, m in self._pairs():
            p.copy_(m)

    @torch.no_grad()
    def params_to_masters(self) -> None:
        """Re-read the masters from the model (after its weights were loaded from elsewhere)."""
        for p, m in self._pairs():
            m.copy_(p)

    def zero_grad(self) -> None:
        for p, m in self._pairs():
            p.grad = None
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [m.detach().cpu() for _, m in self._pairs()]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["masters"]
        pairs = list(self._pairs())
        if len(saved) != len(pairs):
            raise ValueError(f"the checkpoint holds {len(saved)} master weights, the model needs {len(pairs)}")
        for (_, m), value in zip(pairs, saved):
            m.copy_(value)
