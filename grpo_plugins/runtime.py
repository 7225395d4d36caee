"""The processes of a run: the ``accelerate.Accelerator`` and the batch plan for them.

One script runs on a CPU, one GPU, or several processes under ``accelerate launch`` /
``torchrun`` (DDP, or FSDP with ``fsdp:``, see ``sharding.py``; gloo on CPUs); this module checks that what was launched is what the
config's batch arithmetic assumes.
"""

from __future__ import annotations

import atexit
import functools
import os
from typing import Any

import torch

from grpo_plugins.batching import BatchPlan, plan_from_config
from grpo_plugins.config import GRPOConfig
from grpo_plugins.errors import TrainingError


def make_accelerator(config: GRPOConfig, registry: Any = None) -> tuple[Any, BatchPlan]:
    """The run's ``Accelerator`` (fp16 mixed precision for ``dtype: float16``) and batch plan
    (its group filter looked up in ``registry``, default the run's).

    Raises:
        TrainingError: float16 without CUDA, or a process count that differs from the launch
            (``WORLD_SIZE``) or from the config's ``num_processes``.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if config.dtype == "float16" and not torch.cuda.is_available():
        raise TrainingError("dtype: float16 trains with a CUDA gradient scaler; on a CPU use float32 or bfloat16")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    # accelerate only sets up gloo for a CPU-only multi-process launch (torchrun) when told to.
    cpu_only = world > 1 and not torch.accelerator.is_available()
    if world > 1:
        end_process_group_at_exit()
    # Each run sets its own precision: drop the settings an earlier Accelerator in this process
    # (another Engine in a notebook, a benchmark) left behind, keeping the process group.
    AcceleratorState._reset_state(reset_partial_state=False)
    acc = Accelerator(mixed_precision="fp16" if config.dtype == "float16" else "no", cpu=cpu_only)
    if acc.num_processes != world:
        raise TrainingError(
            f"launched as {world} processes (WORLD_SIZE) but accelerate set up {acc.num_processes}; "
            "launch with `accelerate launch` or torchrun on a supported device"
        )
    plan = plan_from_config(config, acc.num_processes, registry)
    if plan.num_processes != acc.num_processes:
        raise TrainingError(
            f"num_processes is {config.num_processes} in the config but the run has "
            f"{acc.num_processes} processes; remove num_processes (it is for plan/validate)"
        )
    return acc, plan


@functools.cache
def end_process_group_at_exit() -> None:
    """Destroy the process group when the interpreter exits (once per process; a no-op if the
    script destroyed it itself).

    A launched process that exits with its gloo group alive can abort in the group's C++
    destructor ("terminate called without an active exception", exit -6) after a run that
    succeeded: its worker threads are torn down with the interpreter. Measured on 2 CPU
    processes: 8 of 40 launches aborted so, none with the group destroyed at exit.
    """
    from grpo_plugins.sharding import end_process_group

    atexit.register(end_process_group)
