"""The ``vllm`` generator's ``mode: server`` against a fake of vLLM 0.26's ``vllm serve`` (dev
mode): an HTTP server in a thread implementing the endpoints the client uses, with vLLM's
request validation for the fields sent, per-sample seeds ``seed + j``, and a fake NCCL channel
(a queue) between the trainer's collective and the server's ``/update_weights``."""

from __future__ import annotations

import json
import queue
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.generators import vllm_server
from grpo_plugins.generators.vllm_backend import SEED_LIMIT, VLLMGenerator, VLLMGeneratorParams
from grpo_plugins.generators.vllm_server import TOKENIZER_PROBE, VLLMServerError
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model

EOS, PAD = 2, 0
INT64_MAX = 2**63 - 1


# -- the fake server --------------------------------------------------------------------------------


class FakeVLLMServer:
    """``VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}'``
    as far as the generator uses it. ``log`` holds (path, body) of every request in order;
    ``script`` maps a prompt (tuple of ids) to the choices to answer; other prompts are sampled
    deterministically from (sample seed, prompt)."""

    def __init__(self, tokenizer: Any, *, model: str = "policy", max_model_len: int = 64, world_size: int = 1) -> None:
        self.tokenizer, self.model, self.max_model_len, self.world_size = tokenizer, model, max_model_len, world_size
        self.vocab_size = len(tokenizer)
        self.token_offset = 0  # > 0: a server with another vocabulary
        self.dev_mode = True
        self.weight_transfer_config: dict | None = {"backend": "nccl"}  # --weight-transfer-config
        self.healthy_at = 0.0  # time.monotonic() from which /health answers 200
        self.fail: dict[str, int] = {}  # path -> HTTP status to answer with
        self.script: dict[tuple[int, ...], list[dict[str, Any]]] = {}
        self.log: list[tuple[str, Any]] = []
        self.weights: dict[str, torch.Tensor] = {}  # what the engine holds after the last update
        self.updates = 0
        self.channel: queue.Queue[torch.Tensor] = queue.Queue()  # the "NCCL" broadcast
        self.rendezvous = threading.Event()
        self._active = False
        self._pending: dict[str, torch.Tensor] = {}
        self._unseeded = 0
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"fake": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [path for path, _ in self.log]

    def bodies(self, path: str) -> list[Any]:
        return [body for p, body in self.log if p == path]

    # -- endpoints: each returns (status, JSON body) --

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/health":
            return (200, None) if time.monotonic() >= self.healthy_at else (503, None)
        with self._lock:
            self.log.append((path, body))
        if path in self.fail:
            return self.fail[path], {"error": {"message": f"boom at {path}\nsecond line", "type": "InternalServerError", "code": self.fail[path]}}
        dev_only = {"/get_world_size", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                    "/finish_weight_update", "/reset_prefix_cache", "/collective_rpc", "/server_info"}
        if path in dev_only and not self.dev_mode:
            return 404, {"detail": "Not Found"}
        route = {
            "/v1/models": lambda: (200, {"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": self.max_model_len}]}),
            "/tokenize": lambda: self.tokenize(body),
            "/v1/completions": lambda: self.completions(body),
            "/get_world_size": lambda: (200, {"world_size": self.world_size}),
            "/server_info": lambda: (200, {"vllm_config": {"weight_transfer_config": self.weight_transfer_config}, "vllm_env": {}}),
            "/init_weight_transfer_engine": lambda: self.init_transfer(body),
            "/start_weight_update": self.start_update,
            "/update_weights": lambda: self.update_weights(body),
            "/finish_weight_update": self.finish_update,
            "/reset_prefix_cache": lambda: (200, {"success": True}),
            "/collective_rpc": lambda: self.collective_rpc(body),
        }.get(path)
        return route() if route else (404, {"detail": "Not Found"})

    def tokenize(self, body: dict) -> tuple[int, Any]:
        ids = self.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        tokens = [(t + self.token_offset) % self.vocab_size for t in ids]
        return 200, {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    def completions(self, body: dict) -> tuple[int, Any]:
        # vLLM 0.26's CompletionRequest checks, for the fields the client sends.
        if body.get("model") not in (None, self.model):
            return 404, {"error": {"message": f"The model `{body['model']}` does not exist.", "type": "NotFoundError", "code": 404}}
        prompt, n, seed = body["prompt"], body.get("n", 1), body.get("seed")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)):
            return 400, {"error": {"message": "prompt must be token ids", "type": "BadRequestError", "code": 400}}
        if seed is not None and not -(2**63) <= seed <= INT64_MAX:
            return 400, {"error": {"message": "seed out of range", "type": "BadRequestError", "code": 400}}
        if body.get("logprobs") is not None and body["logprobs"] < 0:
            return 400, {"error": {"message": "`logprobs` must be a positive value.", "type": "BadRequestError", "code": 400}}
        max_tokens = body.get("max_tokens", 16)
        if len(prompt) + max_tokens > self.max_model_len:
            return 400, {"error": {"message": "too long for max_model_len", "type": "BadRequestError", "code": 400}}
        choices = []
        for j, sampled in enumerate(self.script.get(tuple(prompt)) or [self.sample(prompt, self.sample_seed(seed, j), max_tokens) for j in range(n)]):
            choice = {"index": j, "text": "", "finish_reason": sampled["finish_reason"], "stop_reason": None}
            if body.get("return_token_ids"):
                choice["token_ids"], choice["prompt_token_ids"] = sampled["token_ids"], prompt
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": [f"t{t}" for t in sampled["token_ids"]], "token_logprobs": sampled["token_logprobs"],
                                      "top_logprobs": [{f"t{t}": v} for t, v in zip(sampled["token_ids"], sampled["token_logprobs"])],
                                      "text_offset": list(range(len(sampled["token_ids"])))}
            choices.append(choice)
        return 200, {"id": "cmpl-1", "object": "text_completion", "model": self.model, "choices": choices}

    def sample_seed(self, seed: int | None, j: int) -> int:
        if seed is not None:
            return seed + j  # vLLM's ParentRequest: child j gets seed + j
        with self._lock:
            self._unseeded += 1
            return -self._unseeded

    def sample(self, prompt: list[int], seed: int, max_tokens: int) -> dict[str, Any]:
        rng = random.Random(f"{seed}/{prompt}")
        tokens: list[int] = []
        while len(tokens) < max_tokens and (not tokens or tokens[-1] != EOS):
            tokens.append(EOS if rng.random() < 0.2 else rng.randrange(6, self.vocab_size))
        return {"token_ids": tokens, "token_logprobs": [-0.25 * (1 + t % 4) for t in tokens],
                "finish_reason": "stop" if tokens[-1] == EOS else "length"}

    def init_transfer(self, body: dict) -> tuple[int, Any]:
        info = body.get("init_info")
        if info is None:
            return 400, {"detail": "Missing 'init_info' in request body"}
        if self.weight_transfer_config is None:
            return 500, {"detail": "Weight transfer not configured."}  # and the trainer's rendezvous waits forever
        if set(info) != {"master_address", "master_port", "rank_offset", "world_size"}:
            return 500, {"detail": f"Invalid init_info for NCCLWeightTransferEngine: {sorted(info)}"}
        # The workers join the trainer's NCCL group: this blocks until the trainer joins too.
        return (200, {"message": "Weight transfer initialized"}) if self.rendezvous.wait(5) else (500, {"detail": "NCCL rendezvous timed out"})

    def start_update(self) -> tuple[int, Any]:
        if self._active:
            return 500, {"detail": "start_weight_update called while a weight update is already active"}
        self._active, self._pending = True, {}
        return 200, {"message": "Weight update started"}

    def update_weights(self, body: dict) -> tuple[int, Any]:
        if not self._active:
            return 500, {"detail": "start_weight_update must be called before update_weights."}
        info = body["update_info"]
        for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
            try:
                tensor = self.channel.get(timeout=5)  # the broadcast must run while this request waits
            except queue.Empty:
                return 500, {"detail": "NCCL broadcast timed out"}
            if "base_layer" in name or "lora_" in name:
                return 500, {"detail": f"There is no module or parameter named {name!r} in the model"}
            if str(tensor.dtype).removeprefix("torch.") != dtype or list(tensor.shape) != shape:
                return 500, {"detail": f"{name}: got {tensor.dtype} {list(tensor.shape)}, announced {dtype} {shape}"}
            self._pending[name] = tensor
        return 200, {"message": "Weights updated"}

    def finish_update(self) -> tuple[int, Any]:
        if not self._active:
            return 500, {"detail": "finish_weight_update called without a matching start_weight_update."}
        self._active = False
        self.weights.update(self._pending)
        self.updates += 1
        return 200, {"message": "Weight update finished"}

    def collective_rpc(self, body: dict) -> tuple[int, Any]:
        from safetensors.torch import load_file

        if body.get("method") != "reload_weights":
            return 500, {"detail": f"unknown method {body.get('method')}"}
        files = list(Path(body["kwargs"]["weights_path"]).glob("*.safetensors"))
        for file in files:
            self.weights.update(load_file(file))
        self.updates += 1
        return 200, {"results": [None] * self.world_size}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    fake: FakeVLLMServer

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        status, payload = self.fake.handle(method, self.path.split("?")[0], body)
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._answer("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._answer("POST")

    def log_message(self, *args: Any) -> None:
        pass


class FakeCollective:
    """The trainer's side of the fake NCCL group: joining releases the server's rendezvous,
    sending puts each tensor (a copy, as a broadcast delivers) on the server's channel."""

    def __init__(self, server: FakeVLLMServer) -> None:
        self.server, self.init_infos = server, []

    def trainer_init(self, init_info: dict) -> str:
        self.init_infos.append(init_info)
        self.server.rendezvous.set()
        return "group"

    def send(self, group: Any, weights: Any) -> None:
        assert group == "group"
        for _, tensor in weights:
            self.server.channel.put(tensor.detach().clone())


@pytest.fixture()
def tokenizer(tiny_model: dict) -> Any:
    return load_model(tiny_model)[1]


@pytest.fixture()
def server(tokenizer, monkeypatch) -> Any:
    fake = FakeVLLMServer(tokenizer)
    collectives: list[FakeCollective] = []

    def collective() -> FakeCollective:
        collectives.append(FakeCollective(fake))
        return collectives[-1]

    monkeypatch.setattr(vllm_server, "VLLMCollective", collective)
    fake.collectives = collectives
    yield fake
    fake.close()


def _params(server: FakeVLLMServer, **overrides: Any) -> VLLMGeneratorParams:
    return VLLMGeneratorParams(mode="server", server_port=server.port, server_timeout=5, **overrides)


def _setup(server: FakeVLLMServer, model_spec: dict, params: dict | None = None, lora: dict | None = None, **sampling: Any):
    model, tokenizer = load_model(model_spec, seed=0, **({"lora": lora} if lora else {}))
    gen = VLLMGenerator(_params(server, **(params or {})))
    gen.setup(model, tokenizer, SamplingSettings(**{"max_completion_length": 6, "seed": 11, **sampling}))
    return gen, model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- requests ----------------------------------------------------------------------------------------


def test_each_group_is_one_request_with_token_ids_n_and_its_own_seeds(server, tiny_model: dict) -> None:
    gen, _ = _setup(server, tiny_model, temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
    gen.generate([[7, 8]] * 4 + [[9]] * 4 + [[10, 11, 12]] * 4)
    bodies = sorted(server.bodies("/v1/completions"), key=lambda b: b["seed"])
    base = random.Random("11/0/0").randrange(0, SEED_LIMIT - 12)  # config seed / rank / call 0
    common = {"model": "policy", "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_tokens": 6, "logprobs": 0, "return_token_ids": True}
    assert bodies == [
        {**common, "prompt": [7, 8], "seed": base},
        {**common, "prompt": [9], "seed": base + 4},
        {**common, "prompt": [10, 11, 12], "seed": base + 8},
    ]
    sample_seeds = [b["seed"] + j for b in bodies for j in range(4)]
    assert len(set(sample_seeds)) == 12 and max(sample_seeds) <= INT64_MAX  # no two samples share a stream
    gen.generate([[7, 8]] * 4)
    assert server.bodies("/v1/completions")[-1]["seed"] == random.Random("11/0/1").randrange(0, SEED_LIMIT - 4)


def test_the_seeds_are_the_colocate_paths(server, tiny_model: dict) -> None:
    gen, _ = _setup(server, tiny_model, seed=2**70)
    colocate = VLLMGenerator()
    colocate.sampling = SamplingSettings(seed=2**70)
    gen.generate([[7]] * 2 + [[8]] * 2)
    assert sorted(b["seed"] for b in server.bodies("/v1/completions")) == [colocate.seed_base(4), colocate.seed_base(4) + 2]


def test_without_a_seed_none_is_sent_and_generation_kwargs_pass_through(server, tiny_model: dict) -> None:
    gen, _ = _setup(server, tiny_model, seed=None, extra={"presence_penalty": 0.3, "stop": ["\n\n"]})
    gen.generate([[7], [7]])
    (body,) = server.bodies("/v1/completions")
    assert "seed" not in body and body["n"] == 2
    assert body["presence_penalty"] == 0.3 and body["stop"] == ["\n\n"]


# -- responses ---------------------------------------------------------------------------------------


def test_choices_become_a_generation_output(server, tiny_model: dict) -> None:
    gen, _ = _setup(server, tiny_model)
    server.script = {
        (7,): [{"token_ids": [5, EOS, 6], "token_logprobs": [-0.5, -0.25, -1.0], "finish_reason": "stop"}],  # cut after EOS
        (8,): [{"token_ids": [5, 6, 7, 8, 9, 10], "token_logprobs": [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6], "finish_reason": "length"}],
        (9,): [{"token_ids": [5, 6], "token_logprobs": [-2.0, -9999.0], "finish_reason": "stop"}],  # a stop string: complete
    }
    out = gen.generate([[7], [8], [9]])
    assert out.completion_ids.tolist() == [[5, EOS, PAD, PAD, PAD, PAD], [5, 6, 7, 8, 9, 10], [5, 6, PAD, PAD, PAD, PAD]]
    assert out.completion_mask.tolist() == [[1, 1, 0, 0, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0]]
    assert out.is_truncated.tolist() == [False, True, False]
    expected = torch.tensor([[-0.5, -0.25, 0, 0, 0, 0], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6], [-2.0, -9999.0, 0, 0, 0, 0]])
    torch.testing.assert_close(out.sampling_logps, expected)


def test_the_n_choices_of_a_group_stay_in_order(server, tiny_model: dict) -> None:
    gen, _ = _setup(server, tiny_model, max_completion_length=4)
    out = gen.generate([[7]] * 3 + [[8]] * 3)
    bodies = {tuple(b["prompt"]): b for b in server.bodies("/v1/completions")}
    for row, (prompt, j) in enumerate([((7,), 0), ((7,), 1), ((7,), 2), ((8,), 0), ((8,), 1), ((8,), 2)]):
        sampled = server.sample(list(prompt), bodies[prompt]["seed"] + j, 4)  # re-derived from the seed
        k = len(sampled["token_ids"])
        assert out.completion_ids[row, :k].tolist() == sampled["token_ids"]
        torch.testing.assert_close(out.sampling_logps[row, :k], torch.tensor(sampled["token_logprobs"]))


# -- errors ------------------------------------------------------------------------------------------


def test_an_unreachable_server_is_a_one_line_error_naming_the_fields(tiny_model: dict) -> None:
    port = _free_port()
    model, tokenizer = load_model(tiny_model)
    gen = VLLMGenerator(VLLMGeneratorParams(mode="server", server_port=port, server_timeout=0.3))
    start = time.monotonic()
    with pytest.raises(VLLMServerError) as info:
        gen.setup(model, tokenizer, SamplingSettings())
    message = str(info.value)
    assert message.startswith("generator.params.server_host/server_port: no vLLM server answered at ")
    assert f"http://127.0.0.1:{port}/health within 0.3 s (server_timeout; last: did not answer GET /health (" in message
    assert "\n" not in message
    assert time.monotonic() - start < 3


def test_something_else_than_a_vllm_server_on_the_port_is_named(tiny_model: dict) -> None:
    class Html(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"" if self.path == "/health" else b"<html>a dashboard</html>")

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    model, tokenizer = load_model(tiny_model)
    gen = VLLMGenerator(VLLMGeneratorParams(mode="server", server_port=httpd.server_address[1], server_timeout=2))
    try:
        with pytest.raises(VLLMServerError, match=r"answered GET /v1/models with something other than JSON "
                           r"\('<html>a dashboard</html>'\); is it a vLLM server\?$"):
            gen.setup(model, tokenizer, SamplingSettings())
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_setup_waits_for_the_server_to_become_healthy(server, tiny_model: dict) -> None:
    server.healthy_at = time.monotonic() + 0.8
    gen, _ = _setup(server, tiny_model)
    assert time.monotonic() >= server.healthy_at and gen.served_model == "policy"


def test_an_http_500_names_the_request_and_the_servers_message(server, tiny_model: dict) -> None:
    gen, _ = _setup(server, tiny_model)
    server.fail["/v1/completions"] = 500
    with pytest.raises(VLLMServerError) as info:
        gen.generate([[7], [7]])
    assert str(info.value) == (
        f"generator.params.server_host/server_port: the vLLM server at http://127.0.0.1:{server.port} answered "
        "POST /v1/completions with HTTP 500: boom at /v1/completions second line"
    )


def test_a_server_with_another_vocabulary_is_refused(server, tiny_model: dict) -> None:
    server.token_offset = 1
    with pytest.raises(VLLMServerError, match=r"^generator\.params\.server_model: the model 'policy' served at .* has "
                       r"another tokenizer than the policy .*first difference at token 0\); serve the policy's own checkpoint$"):
        _setup(server, tiny_model)
    assert server.bodies("/tokenize") == [{"model": "policy", "prompt": TOKENIZER_PROBE, "add_special_tokens": False}]


def test_a_model_the_server_does_not_serve_is_refused(server, tiny_model: dict) -> None:
    with pytest.raises(VLLMServerError, match=r"server_model: .* serves \['policy'\], not 'other'"):
        _setup(server, tiny_model, params={"server_model": "other"})


def test_a_server_without_dev_mode_is_told_how_to_start(server, tiny_model: dict) -> None:
    server.dev_mode = False
    with pytest.raises(VLLMServerError, match=r"server_weight_transfer: .* VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config"):
        _setup(server, tiny_model)


def test_a_server_without_the_nccl_backend_is_refused_before_the_rendezvous(server, tiny_model: dict) -> None:
    server.weight_transfer_config = None
    with pytest.raises(VLLMServerError, match=r"server_weight_transfer: .* was started without --weight-transfer-config "
                       r"'\{\"backend\": \"nccl\"\}' \(it has null\); restart it with that flag, or use server_weight_transfer: disk$"):
        _setup(server, tiny_model)
    assert "/init_weight_transfer_engine" not in server.paths() and server.collectives[-1].init_infos == []


@pytest.mark.parametrize(
    ("transfer", "refused"),
    [({"backend": "nccl"}, False), ("WeightTransferConfig(backend='nccl')", False), ({"backend": "ipc"}, True),
     ({"backend": "sparse_nccl"}, True), (None, True)],
)
def test_the_backend_check_reads_the_servers_config(server, transfer: Any, refused: bool) -> None:
    from grpo_plugins.generators.vllm_server import NCCLWeightTransport, ServerClient

    server.weight_transfer_config = transfer
    client = ServerClient("127.0.0.1", server.port, 5)
    if refused:
        with pytest.raises(VLLMServerError, match="was started without --weight-transfer-config"):
            NCCLWeightTransport._check_backend(client)
    else:
        NCCLWeightTransport._check_backend(client)


# -- weight sync -------------------------------------------------------------------------------------


def test_setup_joins_the_nccl_group_and_sends_the_weights(server, tiny_model: dict) -> None:
    gen, model = _setup(server, tiny_model, params={"server_group_port": 40123})
    assert server.bodies("/init_weight_transfer_engine") == [
        {"init_info": {"master_address": "127.0.0.1", "master_port": 40123, "rank_offset": 1, "world_size": 2}}
    ]
    assert server.collectives[-1].init_infos == [{"master_address": "127.0.0.1", "master_port": 40123, "world_size": 2}]
    assert server.updates == 1 and server.weights.keys() == model.state_dict().keys()


def test_an_optimizer_step_sends_start_update_finish_then_resets_the_prefix_cache(server, tiny_model: dict) -> None:
    gen, model = _setup(server, tiny_model)
    server.log.clear()
    with torch.no_grad():  # an optimizer step
        model.model.layers[0].self_attn.q_proj.weight.add_(1.0)
    gen.on_weights_updated(model)
    assert server.paths() == ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    (update,) = server.bodies("/update_weights")
    state = model.state_dict()
    assert update == {"update_info": {
        "names": list(state), "dtype_names": ["float32"] * len(state), "shapes": [list(t.shape) for t in state.values()],
        "packed": True,
    }}
    assert all(torch.equal(server.weights[n], t) for n, t in state.items())
    assert gen.stats["syncs"] == 2


def test_lora_weights_reach_the_server_merged_under_base_names(server, tiny_model: dict) -> None:
    gen, model = _setup(server, tiny_model, lora={"r": 2, "lora_alpha": 4})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)
    gen.on_weights_updated(model)  # the fake refuses peft's names
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    merged = layer.base_layer.weight + layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
    torch.testing.assert_close(server.weights["model.layers.0.self_attn.q_proj.weight"], merged)
    assert server.weights.keys() == load_model(tiny_model)[0].state_dict().keys()


def test_tied_weights_are_sent_once(server, tmp_path) -> None:
    from grpo_plugins.testing import tiny_model_spec

    spec = tiny_model_spec(tmp_path, "qwen2", tie_word_embeddings=True)
    gen, model = _setup(server, spec)
    (update,) = server.bodies("/update_weights")
    assert "lm_head.weight" in model.state_dict() and "lm_head.weight" not in update["update_info"]["names"]


def test_the_disk_transport_has_the_server_reload_a_shared_file(server, tiny_model: dict, tmp_path) -> None:
    gen, model = _setup(server, tiny_model, params={"server_weight_transfer": "disk", "server_weight_dir": str(tmp_path / "w")})
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.add_(1.0)
    server.log.clear()
    gen.on_weights_updated(model)
    assert server.paths() == ["/collective_rpc", "/reset_prefix_cache"]
    assert server.bodies("/collective_rpc") == [
        {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "w"), "is_checkpoint_format": True}}
    ]
    assert [p.name for p in (tmp_path / "w").iterdir()] == ["model.safetensors"]
    assert all(torch.equal(server.weights[n], t) for n, t in model.state_dict().items())
    assert server.bodies("/init_weight_transfer_engine") == []


def test_sync_weights_off_sends_nothing(server, tiny_model: dict) -> None:
    gen, model = _setup(server, tiny_model, params={"sync_weights": False})
    gen.on_weights_updated(model)
    assert server.updates == 0 and "/get_world_size" not in server.paths()


def test_a_failed_update_is_reported_not_hung(server, tiny_model: dict) -> None:
    gen, model = _setup(server, tiny_model)
    server.fail["/update_weights"] = 500
    with pytest.raises(VLLMServerError, match="POST /update_weights with HTTP 500"):
        gen.on_weights_updated(model)


# -- config ------------------------------------------------------------------------------------------


def test_server_mode_validates_and_refuses_sleep_mode() -> None:
    from grpo_plugins.validation import check_config

    config = {"task": "arithmetic", "num_generations": 4, "per_device_train_batch_size": 4,
              "generator": {"name": "vllm", "params": {"mode": "server", "server_host": "10.0.0.2"}}}
    assert check_config(config).problems == []
    with pytest.raises(ValueError, match="enable_sleep_mode is for mode: colocate"):
        VLLMGeneratorParams(mode="server", enable_sleep_mode=True)


# -- an Engine run through the fake server -----------------------------------------------------------


def test_the_engine_trains_through_the_server(server, tiny_model: dict, tmp_path) -> None:
    from grpo_plugins.engine import Engine
    from grpo_plugins.metrics import read_metrics

    model, tokenizer = load_model(tiny_model, dtype="float32", seed=0)
    config = {
        "model": tiny_model, "task": None, "output_dir": str(tmp_path / "out"), "max_steps": 3,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "steps_per_generation": 1,
        "num_generations": 4, "max_completion_length": 6, "learning_rate": 1e-2, "report_to": ["jsonl"], "seed": 0,
        "generator": {"name": "vllm", "params": {"mode": "server", "server_port": server.port, "server_timeout": 10}},
    }
    prompts = [{"prompt": p} for p in ["ab", "cd", "ef", "gh"]]
    result = Engine(config, model=model, tokenizer=tokenizer, rewards=[lambda completions, **kw: [float(len(c)) for c in completions]],
                    dataset=prompts).train()
    assert result.global_step == 3
    assert len(server.bodies("/v1/completions")) == 3  # one group of 4 per step
    assert all(b["n"] == 4 for b in server.bodies("/v1/completions"))
    assert server.updates == 1 + 3  # at setup, then after each optimizer step
    assert all(torch.equal(server.weights[n], t) for n, t in model.state_dict().items())  # the server has the trained weights
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all("sampling/importance_sampling_ratio/mean" in r for r in records)


# -- bench/check_vllm_server.py ----------------------------------------------------------------------


def test_the_gpu_checks_server_command_and_generator_params() -> None:
    from bench import check_vllm_server as check

    args = check.parse_args(["--transport", "nccl", "--server-gpus", "1", "--port", "8123"])
    assert check.server_command(args, "/ckpt")[3:] == [
        "serve", "/ckpt", "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "policy", "--dtype", "bfloat16",
        "--gpu-memory-utilization", "0.3", "--logprobs-mode", "processed_logprobs", "--seed", "0",
        "--weight-transfer-config", '{"backend": "nccl"}',
    ]
    env = check.server_environment(args)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    params = VLLMGeneratorParams(**check.generator(args, sync_weights=False)["params"])
    assert (params.mode, params.server_port, params.server_weight_transfer, params.sync_weights) == ("server", 8123, "nccl", False)


def test_the_nccl_transport_without_vllm_on_the_trainer_says_what_to_do(tokenizer, tiny_model: dict, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    fake = FakeVLLMServer(tokenizer)
    try:
        with pytest.raises(VLLMServerError, match=r"^generator\.params\.server_weight_transfer: nccl needs vLLM .* or use "
                           r"server_weight_transfer: disk \(server on this machine\) or sync_weights: false$"):
            _setup(fake, tiny_model)
    finally:
        fake.close()


def test_generate_ahead_sends_the_next_batch_while_this_one_trains(server, tiny_model: dict, tmp_path) -> None:
    """Server mode with generate_ahead: cycle k+1's requests go out beside cycle k's training,
    before step k's weights reach the server, from another thread; then the weights follow."""
    from grpo_plugins.engine import Engine

    model, tokenizer = load_model(tiny_model, dtype="float32", seed=0)
    config = {
        "model": tiny_model, "task": None, "output_dir": str(tmp_path / "out"), "max_steps": 3,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "steps_per_generation": 1,
        "num_generations": 4, "max_completion_length": 6, "learning_rate": 1e-2, "report_to": ["jsonl"], "seed": 0,
        "generate_ahead": True,
        "generator": {"name": "vllm", "params": {"mode": "server", "server_port": server.port, "server_timeout": 10}},
    }
    threads: list[str] = []
    generate = VLLMGenerator.generate

    def recorded(self: Any, prompt_ids: list[list[int]]) -> Any:
        threads.append(threading.current_thread().name)
        return generate(self, prompt_ids)

    prompts = [{"prompt": p} for p in ["ab", "cd", "ef", "gh"]]
    try:
        VLLMGenerator.generate = recorded  # type: ignore[method-assign]
        result = Engine(config, model=model, tokenizer=tokenizer, rewards=[lambda completions, **kw: [float(len(c)) for c in completions]],
                        dataset=prompts).train()
    finally:
        VLLMGenerator.generate = generate  # type: ignore[method-assign]
    assert result.global_step == 3
    assert threads[0] == threading.current_thread().name and all(t.startswith("generate-ahead") for t in threads[1:]), threads
    # Requests and weight updates in the order the server saw them: cycle 0's batch; cycle 1's
    # batch before step 1's weights; cycle 2's before step 2's; the last step's weights.
    order = [("gen" if p == "/v1/completions" else "upd") for p in server.paths() if p in ("/v1/completions", "/finish_weight_update")]
    assert order == ["upd", "gen", "gen", "upd", "gen", "upd", "upd"], order
    assert all(torch.equal(server.weights[n], t) for n, t in model.state_dict().items())
