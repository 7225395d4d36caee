"""The built-in loss types, importance-sampling levels, reward scalings, rollout corrections and
group filters.

Registered through the ``grpo_plugins`` entry point exactly as a third-party plugin's are; the
core never imports this package. Nothing here imports torch at module level (``grpo-plugins
validate`` must start in well under a second): the tensor code runs inside methods.
"""

from __future__ import annotations

from typing import Any

from grpo_plugins.hookspecs import hookimpl

from builtin_losses import group_filters, importance_sampling, loss_types, reward_scaling, rollout_correction


@hookimpl
def register_loss_types(register: Any) -> None:
    register(loss_types.GRPO, name="grpo")
    register(loss_types.BNPO, name="bnpo")
    register(loss_types.DrGRPO, name="dr_grpo")
    register(loss_types.DAPO, name="dapo")
    register(loss_types.CISPO, name="cispo")
    register(loss_types.SAPO, name="sapo")
    register(loss_types.LUSPO, name="luspo")
    register(loss_types.VESPO, name="vespo")


@hookimpl
def register_importance_sampling_levels(register: Any) -> None:
    register(importance_sampling.TokenLevel, name="token")
    register(importance_sampling.SequenceLevel, name="sequence")


@hookimpl
def register_reward_scalings(register: Any) -> None:
    register(reward_scaling.GroupScaling, name="group")
    register(reward_scaling.BatchScaling, name="batch")
    register(reward_scaling.NoScaling, name="none")


@hookimpl
def register_rollout_corrections(register: Any) -> None:
    register(rollout_correction.TokenTruncate, name="token_truncate")
    register(rollout_correction.TokenMask, name="token_mask")
    register(rollout_correction.SequenceTruncate, name="sequence_truncate")
    register(rollout_correction.SequenceMask, name="sequence_mask")


@hookimpl
def register_group_filters(register: Any) -> None:
    register(group_filters.KeepAll, name="keep_all")
    register(group_filters.DropZeroStd, name="drop_zero_std")
    register(group_filters.AccuracyBand, name="accuracy_band")
