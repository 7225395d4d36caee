"""The client side of the ``vllm`` generator's ``mode: server``: a stock ``vllm serve`` (vLLM
0.26's OpenAI-compatible server started with ``VLLM_SERVER_DEV_MODE=1``) generates, and the
trainer sends it the policy's weights after each optimizer step.

Endpoints used, as vLLM 0.26.0 defines them (``vllm/entrypoints/...``):

* ``GET /health``, ``GET /v1/models``, ``POST /tokenize`` (start-up checks);
* ``POST /v1/completions`` with a token-id ``prompt``, ``n``, ``seed``, ``logprobs: 0`` and
  ``return_token_ids: true`` (one request per prompt group, since a request has one seed);
* weight sync, dev mode only: ``GET /get_world_size``, ``POST /init_weight_transfer_engine``
  ``{"init_info": {...}}``, ``/start_weight_update``, ``/update_weights``
  ``{"update_info": {...}}``, ``/finish_weight_update`` (NCCL transport), or ``POST
  /collective_rpc`` ``{"method": "reload_weights", ...}`` (disk transport); then ``POST
  /reset_prefix_cache``.

HTTP goes through the standard library (urllib); vLLM is imported only by the NCCL transport's
:class:`VLLMCollective`, on the trainer's GPU.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from grpo_plugins.errors import GRPOPluginsError

if TYPE_CHECKING:
    from torch import Tensor

#: A text whose tokenization is compared with the server's at start-up (letters, digits,
#: punctuation, white space and non-ASCII characters, as in prompts and completions).
TOKENIZER_PROBE = "Question: 12 + 34 = ?\nAnswer: 46. (Ünïcode, 数学)"
#: Generation requests in flight at once (one per prompt group); vLLM batches them.
MAX_CONCURRENT_REQUESTS = 64


class VLLMServerError(GRPOPluginsError):
    """The vLLM server of ``mode: server`` is unreachable, refused a request or does not match
    the policy."""


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_message(body: bytes) -> str:
    """The message of a vLLM error response: ``{"error": {"message": ...}}`` (OpenAI routes),
    ``{"detail": ...}`` (FastAPI's HTTPException), ``{"error": "..."}`` (dev routes), or the
    raw text (an unhandled exception's ``Internal Server Error``)."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        return _one_line(text)
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data))
        if isinstance(error, dict):
            error = error.get("message", error)
        return _one_line(error if isinstance(error, str) else json.dumps(error))
    return _one_line(text)


class ServerClient:
    """JSON over HTTP to one vLLM server (``server_host:server_port``); every failure is a
    one-line :class:`VLLMServerError` naming the params field to check."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port = host, port
        self.base_url = f"http://{host}:{port}"
        self.timeout = timeout
        # A cluster-internal server: environment proxies would only get in the way.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """The decoded JSON answer of ``method path`` (None for an empty body)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with self._opener.open(req, timeout=timeout or self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise VLLMServerError(
                f"generator.params.server_host/server_port: the vLLM server at {self.base_url} answered "
                f"{method} {path} with HTTP {exc.code}: {_error_message(exc.read())}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise VLLMServerError(
                f"generator.params.server_host/server_port: the vLLM server at {self.base_url} did not answer "
                f"{method} {path} ({_one_line(str(reason), 120)}); is it still running?"
            ) from None
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            raise VLLMServerError(
                f"generator.params.server_host/server_port: {self.base_url} answered {method} {path} with something "
                f"other than JSON ({_one_line(raw.decode('utf-8', 'replace'), 80)!r}); is it a vLLM server?"
            ) from None

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.request("POST", path, {} if body is None else body, **kwargs)

    def wait_until_healthy(self, timeout: float) -> None:
        """Poll ``GET /health`` until it answers 200 or ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            try:
                self.get("/health", timeout=max(0.1, min(5.0, remaining)))
                return
            except VLLMServerError as exc:
                last = str(exc).split(f"{self.base_url} ", 1)[-1].removesuffix("; is it still running?")
            if remaining <= 0:
                raise VLLMServerError(
                    f"generator.params.server_host/server_port: no vLLM server answered at {self.base_url}/health "
                    f"within {timeout:g} s (server_timeout; last: {_one_line(last, 160)}); start one with "
                    "`vllm serve` (docs/vllm.md, \"Server mode\") or correct the address"
                )
            time.sleep(min(0.5, max(remaining, 0.0)))


def served_model(client: ServerClient, wanted: str | None) -> str:
    """The model name to request: ``wanted`` when the server serves it, else its first model."""
    models = [m.get("id") for m in (client.get("/v1/models") or {}).get("data", [])]
    if wanted is not None and wanted not in models:
        raise VLLMServerError(
            f"generator.params.server_model: the vLLM server at {client.base_url} serves {models}, not {wanted!r}; "
            "set server_model to one of them, or leave it unset to use the first"
        )
    if not models:
        raise VLLMServerError(f"generator.params.server_host/server_port: the vLLM server at {client.base_url} serves no model")
    return wanted if wanted is not None else models[0]


def check_tokenizer(client: ServerClient, model: str, tokenizer: Any) -> None:
    """Refuse a server whose tokenizer (hence vocabulary) differs from the policy's: token ids
    sent and received would mean other tokens."""
    ours = list(tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"])
    theirs = client.post("/tokenize", {"model": model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False})
    theirs = list((theirs or {}).get("tokens", []))
    if theirs != ours:
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise VLLMServerError(
            f"generator.params.server_model: the model {model!r} served at {client.base_url} has another tokenizer "
            f"than the policy (a probe text gives {len(theirs)} tokens there and {len(ours)} here, first "
            f"difference at token {at}); serve the policy's own checkpoint"
        )


def completion_request(model: str, prompt: list[int], fields: dict[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` body of one prompt group; ``fields`` are the sampling fields
    (SamplingParams names, which vLLM's CompletionRequest shares)."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt), **fields}
    body["return_token_ids"] = True  # choices[i].token_ids (the text alone is ambiguous)
    if body.get("seed") is None:
        body.pop("seed", None)
    return body


class ServerCompletion:
    """One choice of a completion response, in the shape of vLLM's ``CompletionOutput``:
    ``token_ids``, ``logprobs`` (one ``{token: log-prob}`` per token, or None), ``finish_reason``."""

    def __init__(self, choice: dict[str, Any], url: str) -> None:
        if choice.get("token_ids") is None:
            raise VLLMServerError(
                f"generator.params.server_host/server_port: the server at {url} returned no token_ids; "
                "it needs vLLM >= 0.10.2 (return_token_ids)"
            )
        self.token_ids: list[int] = list(choice["token_ids"])
        logprobs = choice.get("logprobs")
        values = None if logprobs is None else logprobs.get("token_logprobs")
        self.logprobs: list[dict[int, float]] | None = (
            None if values is None or any(v is None for v in values)
            else [{t: float(v)} for t, v in zip(self.token_ids, values)]
        )
        self.finish_reason: str | None = choice.get("finish_reason")


def generate_on_server(
    client: ServerClient, model: str, prompts: list[list[int]], fields: Callable[[int], dict[str, Any]]
) -> list[ServerCompletion]:
    """Post one completion request per prompt (``fields(i)`` gives request i's sampling fields)
    concurrently; the choices of all requests, in prompt order."""

    def one(i: int) -> list[ServerCompletion]:
        answer = client.post("/v1/completions", completion_request(model, prompts[i], fields(i)))
        choices = sorted(answer.get("choices", []), key=lambda c: c.get("index", 0))
        return [ServerCompletion(c, client.base_url) for c in choices]

    if not prompts:
        return []
    with ThreadPoolExecutor(max_workers=min(MAX_CONCURRENT_REQUESTS, len(prompts))) as pool:
        return [c for request in pool.map(one, range(len(prompts))) for c in request]


def reset_prefix_cache(client: ServerClient, attempts: int = 20) -> None:
    """``POST /reset_prefix_cache``: cached prompt KV entries belong to the old weights. vLLM
    answers ``{"success": false}`` while blocks are held, so it is retried briefly."""
    for _ in range(attempts):
        answer = client.post("/reset_prefix_cache")
        if answer is None or answer.get("success", True):
            return
        time.sleep(0.1)
    raise VLLMServerError(
        f"generator.params.server_host/server_port: the vLLM server at {client.base_url} refused to reset its "
        f"prefix cache {attempts} times (requests still running?)"
    )


# -- weight transports -----------------------------------------------------------------------------


class WeightTransport(Protocol):
    """How the policy's weights reach the server: ``connect`` once at setup (main process),
    ``send`` after each optimizer step, ``close`` at the end."""

    def connect(self, client: ServerClient) -> None: ...

    def send(self, client: ServerClient, weights: Iterator[tuple[str, Tensor]], metadata: list[tuple[str, str, list[int]]]) -> None: ...

    def close(self) -> None: ...


class Collective(Protocol):
    """The trainer's side of the NCCL group with the server's workers."""

    def trainer_init(self, init_info: dict[str, Any]) -> Any: ...

    def send(self, group: Any, weights: Iterator[tuple[str, Tensor]]) -> None: ...


class VLLMCollective:
    """vLLM 0.26's trainer side of the NCCL weight transfer (``NCCLWeightTransferEngine
    .trainer_init`` / ``.trainer_send_weights``, packed broadcast). GPU only: it needs vLLM and
    CUDA on the trainer, and the server's workers on *other* GPUs (NCCL refuses two ranks on one
    GPU). NOT yet run on a GPU; docs/vllm.md says how to check it."""

    def __init__(self) -> None:
        try:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine  # noqa: F401
        except ImportError as exc:
            raise VLLMServerError(
                "generator.params.server_weight_transfer: nccl needs vLLM (its NCCL weight-transfer module, as in 0.26) "
                f"in the training environment too ({exc}); install it, or use server_weight_transfer: disk "
                "(server on this machine) or sync_weights: false"
            ) from None

    def trainer_init(self, init_info: dict[str, Any]) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        return NCCLWeightTransferEngine.trainer_init(init_info)

    def send(self, group: Any, weights: Iterator[tuple[str, Tensor]]) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerSendWeightsArgs,
            NCCLWeightTransferEngine,
        )

        NCCLWeightTransferEngine.trainer_send_weights(
            iterator=weights, trainer_args=NCCLTrainerSendWeightsArgs(group=group, packed=True)
        )


def _while_posting(client: ServerClient, path: str, body: Any, work: Callable[[], Any]) -> Any:
    """POST ``path`` in a thread while ``work()`` runs here (the server's side of an NCCL
    rendezvous or broadcast blocks until the trainer's side takes part); errors of either side
    are raised."""
    failure: list[BaseException] = []

    def post() -> None:
        try:
            client.post(path, body)
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=post, name=f"vllm-server{path}", daemon=True)
    thread.start()
    try:
        result = work()
    finally:
        thread.join()
    if failure:
        raise failure[0]
    return result


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine's interface that routes to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class NCCLWeightTransport:
    """vLLM 0.26's RLHF weight transfer: the trainer's main process joins an NCCL group with
    the server's workers (rank 0; they take ranks 1..W), and each sync is ``/start_weight_update``,
    ``/update_weights`` (names, dtypes, shapes; posted while the tensors are broadcast),
    ``/finish_weight_update``. The server needs ``VLLM_SERVER_DEV_MODE=1`` and
    ``--weight-transfer-config '{"backend": "nccl"}'``."""

    def __init__(self, group_host: str | None, group_port: int, collective: Collective | None = None) -> None:
        self.group_host, self.group_port = group_host, group_port
        self.collective: Collective = collective if collective is not None else VLLMCollective()
        self.group: Any = None

    def connect(self, client: ServerClient) -> None:
        try:
            inference_world = int(client.get("/get_world_size")["world_size"])
        except VLLMServerError as exc:
            if "HTTP 404" not in str(exc):
                raise
            raise VLLMServerError(
                f"generator.params.server_weight_transfer: the vLLM server at {client.base_url} has no weight-transfer "
                "endpoints (HTTP 404 on /get_world_size); start it with VLLM_SERVER_DEV_MODE=1 and "
                "--weight-transfer-config '{\"backend\": \"nccl\"}'"
            ) from None
        self._check_backend(client)
        host = self.group_host or local_address_towards(client.host, client.port)
        world_size = inference_world + 1  # the trainer is rank 0
        init_info = {"master_address": host, "master_port": self.group_port, "rank_offset": 1, "world_size": world_size}
        self.group = _while_posting(
            client, "/init_weight_transfer_engine", {"init_info": init_info},
            lambda: self.collective.trainer_init(
                {"master_address": host, "master_port": self.group_port, "world_size": world_size}
            ),
        )

    @staticmethod
    def _check_backend(client: ServerClient) -> None:
        """Refuse a server started without the NCCL weight-transfer backend before the
        rendezvous, which would otherwise wait for workers that never join. ``/server_info``
        (dev mode) shows the server's config; where it does not answer, nothing is checked."""
        try:
            config = (client.get("/server_info?config_format=json", timeout=120) or {}).get("vllm_config")
        except VLLMServerError:
            return
        if not isinstance(config, dict) or "weight_transfer_config" not in config:
            return
        transfer = config["weight_transfer_config"]  # null, {"backend": ...}, or its str() (dump fallback)
        backend = transfer.get("backend") if isinstance(transfer, dict) else transfer
        if backend is None or "nccl" not in str(backend) or "sparse_nccl" in str(backend):
            raise VLLMServerError(
                f"generator.params.server_weight_transfer: the vLLM server at {client.base_url} was started without "
                f"--weight-transfer-config '{{\"backend\": \"nccl\"}}' (it has {json.dumps(transfer)}); restart it "
                "with that flag, or use server_weight_transfer: disk"
            )

    def send(self, client: ServerClient, weights: Iterator[tuple[str, Tensor]], metadata: list[tuple[str, str, list[int]]]) -> None:
        names, dtypes, shapes = (list(column) for column in zip(*metadata)) if metadata else ([], [], [])
        update_info = {"names": names, "dtype_names": dtypes, "shapes": shapes, "packed": True}
        client.post("/start_weight_update")
        _while_posting(client, "/update_weights", {"update_info": update_info}, lambda: self.collective.send(self.group, weights))
        client.post("/finish_weight_update")

    def close(self) -> None:
        self.group = None


class DiskWeightTransport:
    """Weights through a shared folder: ``model.safetensors`` is written (atomically) to
    ``directory`` and the server reloads it with ``POST /collective_rpc`` ``reload_weights``
    (vLLM's layerwise reload, as in colocate mode). For a server on the same machine, including
    the same GPU, where NCCL cannot pair the two processes. The server needs
    ``VLLM_SERVER_DEV_MODE=1`` and a real checkpoint (not ``--load-format dummy``)."""

    def __init__(self, directory: str | None) -> None:
        self._tmpdir = None if directory else tempfile.TemporaryDirectory(prefix="grpo-plugins-vllm-weights-")
        self.directory = os.path.abspath(directory or self._tmpdir.name)  # type: ignore[union-attr]

    def connect(self, client: ServerClient) -> None:
        os.makedirs(self.directory, exist_ok=True)

    def send(self, client: ServerClient, weights: Iterator[tuple[str, Tensor]], metadata: list[tuple[str, str, list[int]]]) -> None:
        from safetensors.torch import save_file

        tensors = {name: tensor.to("cpu").contiguous() for name, tensor in weights}
        final = os.path.join(self.directory, "model.safetensors")
        partial = final + ".partial"  # not *.safetensors: vLLM's loader never sees a half-written file
        save_file(tensors, partial, metadata={"format": "pt"})
        os.replace(partial, final)
        try:
            client.post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": self.directory, "is_checkpoint_format": True}},
            )
        except VLLMServerError as exc:
            if "HTTP 404" not in str(exc):
                raise
            raise VLLMServerError(
                f"generator.params.server_weight_transfer: the vLLM server at {client.base_url} has no /collective_rpc "
                "(HTTP 404); start it with VLLM_SERVER_DEV_MODE=1"
            ) from None

    def close(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None


#: ``server_weight_transfer`` → transport factory (params → transport).
TRANSPORTS: dict[str, Callable[[Any], WeightTransport]] = {
    "nccl": lambda p: NCCLWeightTransport(p.server_group_host, p.server_group_port),
    "disk": lambda p: DiskWeightTransport(p.server_weight_dir),
}
