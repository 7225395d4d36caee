"""compile_region (sizes symbolic, Python numbers constant) and the compile cache kept between
runs: its key, its atomic file, and a silent-but-logged fallback when it cannot be used."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_plugins.compile_cache import CACHE_ENV, CompileCache, compile_region, default_cache_dir
from grpo_plugins.testing import tiny_model_config


def _model(**overrides: Any) -> Any:
    cfg = tiny_model_config("llama", **overrides)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))


def test_sizes_are_symbolic_and_python_numbers_constants() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    def scaled(x: torch.Tensor, scale: float, heads: int) -> torch.Tensor:
        return (x * scale).view(x.shape[0], heads, -1).sum(-1)

    torch._dynamo.reset()
    fn = compile_region(scaled, backend=backend)
    for rows in (3, 5, 7):  # new sizes: no new graph
        x = torch.randn(rows, 8)
        torch.testing.assert_close(fn(x, 0.5, 2), scaled(x, 0.5, 2), rtol=0, atol=0)
    assert len(graphs) == 1
    placeholders = [n for n in graphs[0].graph.nodes if n.op == "placeholder"]
    # The tensor and its symbolic row count; neither the float nor the int is an input.
    assert all("scale" not in n.name and "heads" not in n.name for n in placeholders)
    assert any(isinstance(n.meta.get("example_value"), torch.Tensor) for n in placeholders)


def test_the_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    for off in ("off", "0", "false", ""):
        monkeypatch.setenv(CACHE_ENV, off)
        assert default_cache_dir() is None
        assert not CompileCache.for_run(_model(), torch.device("cpu"), {}).enabled
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "grpo-plugins" / "compile"


def test_the_cache_file_is_keyed_by_torch_model_shape_and_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu = torch.device("cpu")

    def path(model: Any, settings: dict[str, Any] | None = None) -> Path | None:
        return CompileCache.for_run(model, cpu, settings or {"dtype": "float32"}, tmp_path).path

    base = path(_model())
    assert base is not None and base.parent == tmp_path
    assert path(_model()) == base  # the same shape (other weights): the same file
    assert path(_model(hidden_size=64)) != base
    assert path(_model(num_hidden_layers=3)) != base
    assert path(_model(), {"dtype": "bfloat16"}) != base
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert path(_model()) != base


def test_artifacts_saved_by_one_run_are_loaded_by_the_next(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-first"))
    torch._dynamo.reset()
    counters.clear()
    cache = CompileCache.for_run(_model(), torch.device("cpu"), {"test": "roundtrip"}, tmp_path)
    assert cache.path is not None and not cache.load()  # cold: no file yet
    assert not cache.save_if_new()  # nothing compiled yet: nothing written
    fn = compile_region(lambda x: torch.sin(x) * 2 + 1, backend="inductor")
    x = torch.randn(4, 3)
    expected = fn(x)
    with caplog.at_level(logging.INFO, logger="grpo_plugins.compile_cache"):
        assert cache.save_if_new()
    assert cache.path.is_file() and cache.path.stat().st_size > 0
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, renamed
    assert not cache.save_if_new()  # no new graph since: not rewritten

    # The next run, on a machine whose torch caches are empty: filled from the file.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-next"))
    torch._dynamo.reset()
    counters.clear()
    fresh = CompileCache(cache.path)
    with caplog.at_level(logging.INFO, logger="grpo_plugins.compile_cache"):
        assert fresh.load()
    assert "compile cache: loaded" in caplog.text
    again = compile_region(lambda x: torch.sin(x) * 2 + 1, backend="inductor")
    assert torch.equal(again(x), expected)
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and counters["inductor"]["fxgraph_cache_miss"] == 0
    before = cache.path.stat().st_mtime_ns
    assert not fresh.save_if_new()  # everything came from the caches: the file is left alone
    assert cache.path.stat().st_mtime_ns == before


def test_an_unusable_cache_file_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a cache")
    with caplog.at_level(logging.WARNING, logger="grpo_plugins.compile_cache"):
        assert not CompileCache(bad).load()
    assert "compile cache" in caplog.text and str(bad) in caplog.text
    assert not CompileCache(None).load() and not CompileCache(None).save_if_new()


def test_a_lora_model_gets_the_same_file_in_every_process(tmp_path: Path) -> None:
    """peft keeps target_modules as a set, whose order differs between processes."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from peft import LoraConfig, get_peft_model\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "from grpo_plugins.compile_cache import CompileCache\n"
        "from grpo_plugins.testing import tiny_model_config\n"
        "cfg = tiny_model_config('llama', num_hidden_layers=3)\n"
        "base = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop('model_type'), **cfg))\n"
        "model = get_peft_model(base, LoraConfig(r=4, target_modules='all-linear'))\n"
        f"print(CompileCache.for_run(model, torch.device('cpu'), {{}}, __import__('pathlib').Path({str(tmp_path)!r})).path)\n"
    )
    paths = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        paths.add(out.stdout.strip().splitlines()[-1])
    assert len(paths) == 1, paths


def test_a_compiling_run_loads_the_cache_before_compiling_and_saves_after_steps(
    tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters

    from grpo_plugins.engine import Engine
    from grpo_plugins.models import load_model

    calls: list[tuple[str, Path | None, int]] = []
    monkeypatch.setattr(CompileCache, "load", lambda self: calls.append(("load", self.path, int(counters["stats"]["unique_graphs"]))) or False)
    monkeypatch.setattr(CompileCache, "save_if_new", lambda self: calls.append(("save", self.path, int(counters["stats"]["unique_graphs"]))) or False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    torch._dynamo.reset()
    counters.clear()

    def run(compile_layers: bool) -> None:
        model, tok = load_model(tiny_model, dtype="float32", seed=0, gradient_checkpointing=True)
        cfg = {
            "model": tiny_model, "task": None, "output_dir": str(tmp_path / f"out-{compile_layers}"), "max_steps": 2,
            "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4,
            "report_to": ["jsonl"], "compile_layers": compile_layers,
        }
        Engine(cfg, model=model, tokenizer=tok, rewards=[lambda completions, **kw: [0.0] * len(completions)], dataset=[{"prompt": "ab"}] * 4).train()

    run(False)  # nothing compiles (the CPU's transformers generator, eager layers): no cache at all
    assert [c for c in calls if c[1] is not None] == []
    run(True)
    loads = [c for c in calls if c[0] == "load"]
    saves = [c for c in calls if c[0] == "save" and c[1] is not None]
    assert len(loads) == 1 and loads[-1][1] is not None and loads[-1][1].parent == tmp_path / "cache"
    assert loads[-1][2] == 0  # before anything compiled
    assert len(saves) == 3 and saves[0][2] > 0  # after each optimizer step and at the end, once compiled
    assert all(s[1] == loads[-1][1] for s in saves)
