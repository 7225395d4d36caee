"""bench/bench_unsloth.py without Unsloth: its arguments, the JSON it writes when the import, the
load or a SIGTERM stops it (stage, error type, message, failing frame per library), and a whole
run on the CPU with a stand-in ``unsloth`` package (transformers + PEFT behind Unsloth's names)
and TRL's own GRPOTrainer, which the script must report as not Unsloth's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "bench_unsloth.py"


@pytest.fixture()
def bench_unsloth(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import bench.bench_unsloth as module

    return module


def _package(root: Path, name: str, source: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(textwrap.dedent(source))


def _start(fake: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_arguments_and_their_checks(bench_unsloth, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_unsloth.parse_args(["--fast-inference", "--shape", "qwen2.5-7b", "--tokens", "1024"])
    assert args.fast_inference and args.gpu_memory_utilization == 0.3 and args.rows == 64 and not args.match_ours
    assert bench_unsloth.out_path_for(args).name == "unsloth.json"
    assert bench_unsloth.out_path_for(bench_unsloth.parse_args(["--save-only", "--model-dir", "/m"])) is None
    for bad, message in (
        (["--rows", "60"], "multiple of 8"),
        (["--rows", "64", "--micro-rows", "24"], "not a multiple of --micro-rows 24"),
        (["--gpu-memory-utilization", "1.5"], "between 0 and 1"),
        (["--shape", "llama-70b"], "invalid choice"),
    ):
        with pytest.raises(SystemExit) as stop:
            bench_unsloth.parse_args(bad)
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_failing_import_still_writes_the_json_with_the_failing_frames(tmp_path: Path) -> None:
    # As when `import unsloth` imports a vLLM whose compiled library does not load.
    fake = tmp_path / "fake"
    _package(fake, "unsloth", "import vllm\n")
    _package(fake, "vllm", "\n\nraise ImportError('libcudart.so.13: cannot open shared object file')\n")
    out = tmp_path / "run.json"
    process = _start(fake, "--fast-inference", "--shape", "qwen2.5-0.5b", "--tokens", "1024", "--out", str(out))
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 1, stderr
    data = json.loads(out.read_text())
    assert data["stage"] == "import unsloth" and data["framework"] == "unsloth-fast-inference"
    assert data["gpu_memory_utilization"] == 0.3 and data["tokens"] == 1024 and data["shape"] == "qwen2.5-0.5b"
    error = data["error"]
    assert error["type"] == "ImportError" and error["message"] == "libcudart.so.13: cannot open shared object file"
    assert error["frame"].startswith(f"{fake / 'vllm' / '__init__.py'}:3 in <module>: raise ImportError")
    assert error["library_frames"]["vllm"] == error["frame"]
    assert error["library_frames"]["unsloth"].startswith(f"{fake / 'unsloth' / '__init__.py'}:1 in <module>: import vllm")
    assert "Traceback" in error["traceback"] and data["checks_failed"] == []
    assert "=== FAILED in stage 'import unsloth': ImportError: libcudart.so.13" in stderr
    assert f"=== in vllm: {fake / 'vllm' / '__init__.py'}:3" in stderr
    assert f"wrote {out}" in stdout


def test_sigterm_from_a_timeout_still_writes_the_json(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    _package(fake, "unsloth", "import time\ntime.sleep(120)\n")
    out = tmp_path / "run.json"
    process = _start(fake, "--out", str(out))
    deadline = time.monotonic() + 60
    while not (out.exists() and json.loads(out.read_text())["stage"] == "import unsloth"):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.2)
    time.sleep(0.5)  # inside the import's sleep
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    data = json.loads(out.read_text())
    assert data["stage"] == "import unsloth"
    assert data["error"]["type"].endswith("Stopped")
    assert data["error"]["message"] == "stopped by signal SIGTERM (the driver's timeout)"
    assert data["error"]["library_frames"]["unsloth"].startswith(f"{fake / 'unsloth' / '__init__.py'}:2")


#: Unsloth's names over transformers and PEFT, for a CPU run of the whole script with TRL's trainer.
STAND_IN = '''
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

__version__ = "stand-in"


class FastLanguageModel:
    @staticmethod
    def from_pretrained(model_name, max_seq_length, dtype, load_in_4bit, fast_inference, max_lora_rank, **kwargs):
        assert not fast_inference and not kwargs
        tokenizer = AutoTokenizer.from_pretrained(model_name)
        tokenizer.padding_side = "left"
        return AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32), tokenizer

    @staticmethod
    def get_peft_model(model, r, lora_alpha, random_state, use_gradient_checkpointing, target_modules):
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules))
'''


def test_a_cpu_run_with_trls_trainer_is_measured_and_flagged_as_not_unsloth(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_plugins.testing import build_tiny_tokenizer
    from grpo_plugins.testing.tiny import tiny_vocab_size

    model_dir = tmp_path / "model"
    config = AutoConfig.for_model(
        "qwen2", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=tiny_vocab_size(), max_position_embeddings=2048,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(tmp_path / "tok"))).save_pretrained(model_dir)
    fake = tmp_path / "fake"
    _package(fake, "unsloth", STAND_IN)
    out = tmp_path / "run.json"
    process = _start(
        fake, "--model-dir", str(model_dir), "--tokens", "4", "--rows", "16", "--steps", "1", "--warmup", "1",
        "--match-ours", "--out", str(out),
    )
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 2, stderr  # measured, but not by Unsloth's trainer
    data = json.loads(out.read_text())
    assert "error" not in data and data["stage"] == "done"
    assert data["trainer"] == "GRPOTrainer" and data["unsloth"] is None  # the stand-in has no distribution
    assert data["checks_failed"] == ["the trainer is 'GRPOTrainer', not UnslothGRPOTrainer: Unsloth's patch did not apply"]
    assert len(data["step_times"]) == 2 and data["step_s"] == data["step_times"][1]
    assert data["prepare_inputs_s"] is not None and 0 < data["train_s"] < data["step_s"]
    assert data["generate_s"] is not None and data["generate_s"] <= data["prepare_inputs_s"]
    assert len(data["profiling_per_step"]) == 2 and data["mean_length"] is not None
    used = data["settings_used"]
    assert used["mask_truncated_completions"] is False and used["epsilon_high"] == 0.2 and used["optim"] == "adamw_torch"
    assert used["loss_type"] == "dapo" and used["beta"] == 0.0 and used["per_device_train_batch_size"] == 16
    assert data["passed_settings"]["epsilon_high"] == 0.2 and "use_vllm" not in data["passed_settings"]
    assert data["vllm_generate_calls"] == 0 and data["trainer_vllm_is_unsloth_engine"] is None
    assert data["tokenizer_used"]["padding_side"] == "left"
    assert "WARNING: the trainer is 'GRPOTrainer'" in stdout


def test_engine_facts_read_the_config_and_the_kv_cache_of_an_in_process_engine(bench_unsloth) -> None:
    import torch

    config = SimpleNamespace(
        cache_config=SimpleNamespace(gpu_memory_utilization=0.297, num_gpu_blocks=1000, block_size=16, cache_dtype="auto"),
        scheduler_config=SimpleNamespace(max_num_seqs=96, max_num_batched_tokens=8192),
        model_config=SimpleNamespace(max_model_len=2048, enforce_eager=False),
        compilation_config=SimpleNamespace(mode=3, cudagraph_mode="FULL_AND_PIECEWISE"),
        lora_config=SimpleNamespace(max_lora_rank=16, max_loras=1),
    )
    runner = SimpleNamespace(kv_caches=[torch.zeros(2, 4), torch.zeros(3)])  # CPU tensors: no GPU bytes
    driver = SimpleNamespace(model_runner=runner)
    engine_core = SimpleNamespace(engine_core=SimpleNamespace(model_executor=SimpleNamespace(driver_worker=driver)))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config, engine_core=engine_core))
    facts = bench_unsloth.vllm_engine_facts(llm)
    assert facts["gpu_memory_utilization"] == 0.297 and facts["num_gpu_blocks"] == 1000 and facts["max_num_seqs"] == 96
    assert facts["max_model_len"] == 2048 and facts["lora"] == {"max_lora_rank": 16, "max_loras": 1}
    assert facts["compilation"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert facts["model_runner"] == "types.SimpleNamespace" and facts["kv_cache_gib"] is None
    broken = bench_unsloth.vllm_engine_facts(SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config)))
    assert broken["model_runner"].startswith("not reachable: AttributeError")
