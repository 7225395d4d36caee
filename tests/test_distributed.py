"""Two CPU processes (torchrun, gloo) train exactly like one process on the same data.

The global batch is the same (2 x 4 completions per micro-step vs. 1 x 8), rewards are scaled
over the whole batch (``scale_rewards: batch``) so every advantage depends on the gathered
rewards, and dapo's normaliser counts the tokens of both processes. A deterministic generator
(completions a function of the prompt and of its occurrence in the batch) gives both runs the
same completions. This file is also the script the runs execute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]


def char_sum(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def char_sum_or_constant(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """char_sum, but constant (a zero-std group) for three of the eight prompts."""
    return [1.0 if p in ("cd", "gh", "kl") else float(sum(map(ord, c)) % 7) for p, c in zip(prompts, completions)]


def _fixed_generator() -> type:
    import torch

    from grpo_plugins.kinds import GenerationOutput, Generator

    class FixedGenerator(Generator):
        """Test stand-in: completion k of a prompt in a batch is a fixed function of (prompt, k)."""

        def generate(self, prompt_ids: list[list[int]]) -> GenerationOutput:
            T, eos, pad = self.sampling.max_completion_length, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
            seen: dict[tuple[int, ...], int] = {}
            rows, truncated = [], []
            for ids in prompt_ids:
                k = seen.get(tuple(ids), 0)
                seen[tuple(ids)] = k + 1
                h = zlib.crc32(bytes(str((ids, k)), "ascii"))
                length = 2 + h % (T - 1)  # 2..T
                tokens = [10 + (h >> (3 * j)) % 60 for j in range(length)]
                ends = h % 3 != 0 and length < T
                if ends:
                    tokens.append(eos)
                rows.append(tokens)
                truncated.append(not ends)
            width = max(len(r) for r in rows)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            return GenerationOutput(completion_ids=ids, completion_mask=mask, is_truncated=torch.tensor(truncated))

        def generate_beside(self, prompt_ids: list[list[int]]) -> Any:
            return lambda: self.generate(prompt_ids)

    return FixedGenerator


def _config(tiny_model: dict, output_dir: Path, per_device: int) -> dict[str, Any]:
    return {
        "model": tiny_model,
        "task": None,
        "output_dir": str(output_dir),
        "generator": "fixed_test",
        "max_steps": 4,  # 2 cycles x 2 updates (num_iterations 2): off-policy second pass
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": 2,
        "steps_per_generation": 2,
        "num_iterations": 2,
        "num_generations": 4,
        "max_completion_length": 8,
        "scale_rewards": "batch",
        "loss_type": "dapo",
        "beta": 0.05,
        "learning_rate": 1e-2,
        "report_to": ["jsonl"],
        "log_completions": True,
        "seed": 5,
        # One pass per micro-step on both sides: one process of 8 rows and two of 4 would group
        # their rows differently and sum in other orders (grouping's own equality is tested in
        # test_length_grouping.py).
        "group_by_length": False,
    }


def _env() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


# Each launch takes a free port (torchrun --standalone, accelerate's port 0): fixed ports collide
# with other runs on the machine, and with this suite's own runs under pytest -n.
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    # accelerate's --cpu flag means one process (or mpirun); its multi-process launcher is torchrun's.
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"],
}


def one_process_run(tiny_model: dict, root: Path) -> Path:
    """One process of 8 rows a micro-step trains ``_config`` unchanged; its output folder. The
    ``one_process_run`` fixture (conftest.py) runs it once for every test comparing with it."""
    (root / "one.json").write_text(json.dumps(_config(tiny_model, root / "one", per_device=8)))
    run = subprocess.run([sys.executable, __file__, str(root / "one.json")], env=_env(), capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    return root / "one"


#: Generating ahead changes nothing here: the fixed generator's completions do not depend on the
#: weights, and without its log-probs the correction is off. So the two processes, each with a
#: generation thread beside its training, must still train exactly as one process without.
AHEAD = {"generate_ahead": True, "vllm_importance_sampling_correction": False}


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "changes"), [(name, {}) for name in LAUNCHERS] + [("torchrun", AHEAD)], ids=[*LAUNCHERS, "torchrun-ahead"])
def test_two_processes_match_one(tiny_model: dict, one_process_run: Path, tmp_path: Path, launcher: str, changes: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file

    from grpo_plugins.metrics import read_metrics

    one, two = one_process_run, tmp_path / "two"
    (tmp_path / "two.json").write_text(json.dumps({**_config(tiny_model, two, per_device=4), **changes}))
    run = subprocess.run(
        [*LAUNCHERS[launcher], __file__, str(tmp_path / "two.json")],
        env=_env(), capture_output=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]

    def completions(out: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]

    c1, c2 = completions(one), completions(two)
    assert len(c1) == len(c2) == 2 * 16
    assert [(r["prompt"], r["completion"]) for r in c1] == [(r["prompt"], r["completion"]) for r in c2]
    adv1 = torch.tensor([r["advantage"] for r in c1])
    adv2 = torch.tensor([r["advantage"] for r in c2])
    assert adv1.abs().sum() > 0
    torch.testing.assert_close(adv2, adv1, rtol=0, atol=1e-6)

    w1 = load_file(str(one / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    init = None
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=1e-5)
        init = key
    assert init is not None
    m1, m2 = read_metrics(one), read_metrics(two)
    for r1, r2 in zip(m1, m2, strict=True):
        for key in ("reward", "reward_std", "loss", "grad_norm", "kl", "num_tokens", "completions/mean_length"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_two_processes_match_one_with_dynamic_sampling(tiny_model: dict, tmp_path: Path) -> None:
    """Groups are kept, refilled and redistributed over the processes exactly as in one process."""
    import torch
    from safetensors.torch import load_file

    from grpo_plugins.metrics import read_metrics

    one, two = tmp_path / "one", tmp_path / "two"
    for out, per_device in ((one, 8), (two, 4)):
        config = {**_config(tiny_model, out, per_device), "group_filter": "drop_zero_std", "max_refill_rounds": 1}
        (tmp_path / f"{out.name}.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, __file__, str(tmp_path / "one.json")], env=_env(), capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    run = subprocess.run([*LAUNCHERS["torchrun"], __file__, str(tmp_path / "two.json")], env=_env(), capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-3000:]

    def completions(out: Path) -> list[tuple[str, str, float]]:
        rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        return [(r["prompt"], r["completion"], r["advantage"]) for r in rows]

    c1, c2 = completions(one), completions(two)
    assert c1 and [r[:2] for r in c1] == [r[:2] for r in c2]
    assert not {p for p, _, _ in c1} & {"cd", "gh", "kl"}  # the constant prompts were never trained on
    torch.testing.assert_close(torch.tensor([r[2] for r in c2]), torch.tensor([r[2] for r in c1]), rtol=0, atol=1e-6)
    w1 = load_file(str(one / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    for key in w1:  # DDP sums gradients in another order; Adam turns that into ~1e-5 differences
        torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=5e-5)
    m1, m2 = read_metrics(one), read_metrics(two)
    assert sum(r["group_filter/groups_dropped"] for r in m1) > 0
    for r1, r2 in zip(m1, m2, strict=True):
        for key in [k for k in r1 if k.startswith("group_filter/")] + ["loss", "num_tokens", "frac_reward_zero_std"]:
            assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), key


def _one_and_two(tiny_model: dict, tmp_path: Path, changes: dict[str, Any]) -> tuple[Path, Path]:
    """The config with ``changes`` trained by one process of 8 rows and by two (torchrun) of 4;
    their output folders."""
    one, two = tmp_path / "one", tmp_path / "two"
    (tmp_path / "one.json").write_text(json.dumps({**_config(tiny_model, one, per_device=8), **changes}))
    (tmp_path / "two.json").write_text(json.dumps({**_config(tiny_model, two, per_device=4), **changes}))
    for command in ([sys.executable, __file__, str(tmp_path / "one.json")],
                    [*LAUNCHERS["torchrun"], __file__, str(tmp_path / "two.json")]):
        run = subprocess.run(command, env=_env(), capture_output=True, timeout=300)
        assert run.returncode == 0, run.stderr.decode()[-3000:]
    return one, two


@pytest.mark.slow
def test_top_entropy_quantile_takes_its_threshold_over_all_processes(tiny_model: dict, tmp_path: Path) -> None:
    """One micro-step = the same 8 rows on one process and 4 + 4 on two; the top-entropy
    threshold is taken over both processes' tokens, so the runs train alike."""
    from safetensors.torch import load_file

    import torch

    one, two = _one_and_two(tiny_model, tmp_path, {"gradient_accumulation_steps": 1, "steps_per_generation": 1, "top_entropy_quantile": 0.5})
    w1 = load_file(str(one / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "checkpoint-4" / "model" / "model.safetensors"))
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], rtol=0, atol=1e-5)


def test_a_launched_process_destroys_its_process_group_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gloo group left alive at exit can abort a process whose run succeeded (exit -6): a
    multi-process run registers the group's destruction at exit, once, a no-op if it is gone."""
    import atexit

    import torch.distributed as dist

    from grpo_plugins import runtime

    registered: list[Any] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    runtime.end_process_group_at_exit.cache_clear()
    try:
        runtime.end_process_group_at_exit()
        runtime.end_process_group_at_exit()
        assert len(registered) == 1
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        registered[0]()
        assert not dist.is_initialized()
        registered[0]()  # already gone: nothing to do
    finally:
        runtime.end_process_group_at_exit.cache_clear()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_train_lora_on_a_float8_base(tiny_model: dict, tmp_path: Path) -> None:
    """DDP over a float8 base (``load_in_fp8``): the processes start in step (its buffers pass
    DDP's broadcast) and train like one process, up to float8's rounding of slightly different
    float sums (a value near a rounding edge can round the other way)."""
    from grpo_plugins.metrics import read_metrics

    one, two = _one_and_two(tiny_model, tmp_path, {"lora": {"r": 4, "target_modules": "all-linear"}, "load_in_fp8": True, "beta": 0.0})
    m1, m2 = read_metrics(one), read_metrics(two)
    assert len(m1) == len(m2) == 4
    assert m2[0]["loss"] == pytest.approx(m1[0]["loss"], rel=1e-4, abs=1e-6)  # the same start
    for r1, r2 in zip(m1, m2):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=0.02, abs=1e-3)
        assert r2["reward"] == r1["reward"]


if __name__ == "__main__":  # a training process: CONFIG.json
    from grpo_plugins.engine import Engine
    from grpo_plugins.registry import get_registry

    get_registry().register("generator", "fixed_test", _fixed_generator())
    config = json.loads(Path(sys.argv[1]).read_text())
    reward = char_sum_or_constant if config.get("group_filter") else char_sum
    Engine(config, rewards=[reward], dataset=PROMPTS).train()
