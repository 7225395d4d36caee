"""GPU check of the ``vllm`` generator's ``mode: server`` against a real ``vllm serve``.

    python bench/check_vllm_server.py --out $OUT/check_vllm_server.json

Writes the benchmark's random-init model (bench/_common.py: Qwen2-0.5B shape, bf16, the SmolLM2
tokenizer in .benchdata/tokenizer) as a checkpoint, starts ``VLLM_SERVER_DEV_MODE=1 python -m
vllm.entrypoints.cli.main serve <checkpoint> ...`` as a subprocess (on the same GPU unless
``--server-gpus`` says otherwise; its log goes next to ``--out``), waits for it, then trains
through it with check_vllm.py's ``run`` (same workload and per-step records):

* ``sync``: ``--steps`` steps of ``--completions`` x ``--tokens`` at ``--lr``, weights sent
  after every step through ``--transport``. Expected: the mean |sampler - trainer| log-prob per
  token stays at bf16 noise (colocate mode: ~0.005-0.007) and the IS ratio near 1.
* ``nosync``: the same with ``sync_weights: false``; the mismatch should grow. It runs first,
  while the server still holds the checkpoint's weights (the run's initial ones).

``--transport disk`` (default) works with the server on the trainer's GPU; ``--transport nccl``
needs the server on another GPU (NCCL refuses two ranks on one device): on a 2-GPU machine,
``--transport nccl --server-gpus 1``. The server is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS: dict[str, Any] = {"runs": {}, "errors": []}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("check_vllm_server.json"))
    p.add_argument("--parts", nargs="+", choices=("sync", "nosync"), default=["sync", "nosync"])
    p.add_argument("--transport", choices=("disk", "nccl"), default="disk")
    p.add_argument("--server-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the server; default: the trainer's")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--group-port", type=int, default=51216)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--completions", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--enforce-eager", action="store_true", help="faster server start, slower decoding")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for the server to start")
    return p.parse_args(argv)


def server_command(args: argparse.Namespace, checkpoint: str) -> list[str]:
    """The ``vllm serve`` command line (vLLM 0.26 flags) for ``checkpoint``."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", checkpoint,
        "--host", "127.0.0.1", "--port", str(args.port), "--served-model-name", "policy",
        "--dtype", "bfloat16", "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--logprobs-mode", "processed_logprobs", "--seed", "0",
    ]
    if args.transport == "nccl":
        command += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if args.enforce_eager:
        command.append("--enforce-eager")
    return command


def server_environment(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's engine core runs in its own process
    if args.server_gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = args.server_gpus
    return env


def wait_for_server(args: argparse.Namespace, server: subprocess.Popen, log_path: Path) -> None:
    """Until ``GET /health`` answers; raises with the log's tail if the server exits first."""
    from grpo_plugins.generators.vllm_server import ServerClient, VLLMServerError

    client = ServerClient("127.0.0.1", args.port, 5.0)
    deadline = time.monotonic() + args.server_timeout
    while True:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vllm serve exited {server.returncode}; the end of {log_path}:\n{tail}")
        try:
            client.get("/health")
            return
        except VLLMServerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def generator(args: argparse.Namespace, **params: Any) -> dict[str, Any]:
    return {"name": "vllm", "params": {
        "mode": "server", "server_port": args.port, "server_model": "policy", "server_timeout": args.server_timeout,
        "server_weight_transfer": args.transport, "server_group_port": args.group_port, **params,
    }}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    probe = subprocess.run([sys.executable, "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True, text=True)
    if probe.returncode != 0:
        print("vLLM's server does not import here (install vLLM with its serving dependencies: uvicorn, uvloop, "
              f"prometheus-fastapi-instrumentator, ...):\n{probe.stderr[-2000:]}", file=sys.stderr)
        return 2
    import torch

    from bench import check_vllm
    from bench._common import build_model, load_tokenizer, write_json
    from grpo_plugins.generators.vllm_backend import write_engine_checkpoint

    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    checkpoint = tempfile.mkdtemp(prefix="check_vllm_server_ckpt_")
    model = build_model(seed=0)  # the same weights run() builds with seed 0
    write_engine_checkpoint(model, load_tokenizer(), checkpoint)
    del model
    torch.cuda.empty_cache()
    log_path = args.out.with_suffix(".server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = server_command(args, checkpoint)
    RESULTS["server_command"] = " ".join(command)
    print("starting:", RESULTS["server_command"], flush=True)
    with open(log_path, "w") as server_log:
        server = subprocess.Popen(command, env=server_environment(args), stdout=server_log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    start = time.perf_counter()
    try:
        # Before the trainer allocates anything: vLLM sizes its KV cache from the GPU's memory at start-up.
        try:
            wait_for_server(args, server, log_path)
        except Exception as exc:
            RESULTS["errors"].append({"run": "server", "error": repr(exc), "trace": traceback.format_exc()})
            print(exc, file=sys.stderr, flush=True)
            return 1
        RESULTS["server_start_s"] = time.perf_counter() - start
        print(f"server up after {RESULTS['server_start_s']:.1f} s", flush=True)
        # nosync first, while the server still holds the checkpoint's (= the run's initial) weights;
        # sync sends the policy's weights at its start anyway.
        for part in sorted(args.parts, key=["nosync", "sync"].index):
            params = {} if part == "sync" else {"sync_weights": False}
            print(f"== {part}", flush=True)
            try:
                record = check_vllm.run(part, generator=generator(args, **params), completions=args.completions,
                                        tokens=args.tokens, steps=args.steps, lr=args.lr)
            except Exception as exc:
                record = {"error": repr(exc)}
                RESULTS["errors"].append({"run": part, "error": repr(exc), "trace": traceback.format_exc()})
                traceback.print_exc()
            RESULTS["runs"][part] = record
            write_json(args.out, RESULTS)
            if server.poll() is not None:
                RESULTS["errors"].append({"run": part, "error": f"the server exited {server.returncode}; see {log_path}"})
                break
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and its engine-core process
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        write_json(args.out, RESULTS)
    from importlib.metadata import PackageNotFoundError, version

    try:
        served_by = f"{version('vllm')} (server)"
    except PackageNotFoundError:
        served_by = "? (server)"
    check_vllm.RESULTS.update(RESULTS, vllm=served_by)
    print(check_vllm.table(), flush=True)
    print(f"server log: {log_path}", flush=True)
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
