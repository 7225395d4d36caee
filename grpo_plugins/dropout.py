"""Whether a model's training pass draws random numbers: dropout with a nonzero rate.

Activation checkpointing saves and restores the random state around each recomputed segment
only where this says so (there is nothing to replay otherwise), and ``generate_ahead`` needs a
training pass that leaves the random state alone, since the next batch samples from it beside
the pass.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dropout_in"]


def dropout_in(model: Any) -> str | None:
    """The first dropout of ``model`` with a nonzero rate, as ``module name (p)`` or ``config key
    = value`` (transformers models apply attention dropout from their config), or None."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{name or 'the model'} (p={module.p})"
    configs = [getattr(m, "config", None) for m in (model, getattr(model, "get_base_model", lambda: None)())]
    for config in configs:
        for key, value in (config.to_dict() if hasattr(config, "to_dict") else {}).items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return f"{key} = {value} in the model's config"
    return None
