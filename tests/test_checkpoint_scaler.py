"""The float16 gradient scaler's state travels with a checkpoint (exact fp16 resume)."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_plugins.checkpoint import load_checkpoint, save_checkpoint
from grpo_plugins.models import load_model


class _OneProcess:
    is_main_process = True
    process_index = 0

    def wait_for_everyone(self) -> None:
        pass


def test_scaler_scale_and_growth_tracker_are_saved_and_restored(tiny_model: dict, tmp_path: Path) -> None:
    model, tokenizer = load_model(tiny_model, dtype="float32", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    path = save_checkpoint(
        _OneProcess(), tmp_path, 3, model=model, tokenizer=tokenizer, optimizer=optimizer,
        scheduler=scheduler, rng_state={}, rollout=None, state={"global_step": 3},
        config_yaml="{}\n", save_total_limit=None, scaler=scaler,
    )
    fresh = torch.amp.GradScaler("cpu")  # scale 2**16, growth interval 2000
    load_checkpoint(path, _OneProcess(), model=model, optimizer=optimizer, scheduler=scheduler, scaler=fresh)
    assert fresh.get_scale() == 2.0**10
    assert fresh.state_dict()["growth_interval"] == 7


def test_a_checkpoint_without_a_scaler_loads_with_none(tiny_model: dict, tmp_path: Path) -> None:
    model, tokenizer = load_model(tiny_model, dtype="float32", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    path = save_checkpoint(
        _OneProcess(), tmp_path, 1, model=model, tokenizer=tokenizer, optimizer=optimizer,
        scheduler=scheduler, rng_state={}, rollout=None, state={"global_step": 1},
        config_yaml="{}\n", save_total_limit=None,
    )
    assert not (path / "scaler.pt").exists()
    state, _, _ = load_checkpoint(path, _OneProcess(), model=model, optimizer=optimizer, scheduler=scheduler)
    assert state["global_step"] == 1
