"""completion_logps: the chunked selective log-softmax equals the naive full-logits computation,
in values and gradients, and never forms more than one chunk of logits. Rows run without a
padding mask (moved to their start), so the values at a completion's padding positions, which
nothing reads, differ from a masked forward's: comparisons cover the real positions."""

from __future__ import annotations

import pytest
import torch

from grpo_plugins.logprobs import (
    _logit_transform,
    chunked_selective_logps,
    completion_logps,
    left_aligned,
    position_ids_from_mask,
)
from grpo_plugins.models import load_model
from grpo_plugins.testing import tiny_model_config, tiny_vocab_size

B, P, T = 3, 5, 7


@pytest.fixture()
def model64(tiny_model: dict) -> torch.nn.Module:
    model, _ = load_model(tiny_model, dtype="float32", seed=1)
    return model.double()


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, tiny_vocab_size(), (B, P + T), generator=gen)  # (B, P+T)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of a short prompt
    mask[1, -3:] = 0  # a completion that ended early
    return ids, mask


def _real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` (B, T) at the completion's real tokens, zero at its padding."""
    return x * mask[:, -T:]


def _naive(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, temperature: float):
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logits = logits[:, -T - 1 : -1] / temperature  # (B, T, V)
    logp_all = torch.log_softmax(logits, dim=-1)
    logps = logp_all.gather(-1, ids[:, -T:, None]).squeeze(-1)  # (B, T)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, T)
    return logps, entropy


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("chunk_size", [1, 5, 4096])
def test_values_and_gradients_equal_naive_log_softmax_in_float64(model64, chunk_size: int) -> None:
    ids, mask = _batch()
    logps, entropy = completion_logps(
        model64, ids, mask, T, temperature=0.7, chunk_size=chunk_size, with_entropy=True
    )
    weights = _real(torch.linspace(0.5, 1.5, B * T, dtype=torch.float64).reshape(B, T), mask)
    (logps * weights).sum().backward()
    fast_grads = _grads(model64)

    ref_logps, ref_entropy = _naive(model64, ids, mask, 0.7)
    (ref_logps * weights).sum().backward()
    ref_grads = _grads(model64)

    assert logps.shape == (B, T) and logps.dtype == torch.float64
    torch.testing.assert_close(_real(logps, mask), _real(ref_logps, mask), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(_real(entropy, mask), _real(ref_entropy, mask), atol=1e-12, rtol=1e-10)
    assert len(fast_grads) == len(ref_grads) > 0
    for fast, ref in zip(fast_grads, ref_grads):
        torch.testing.assert_close(fast, ref, atol=1e-12, rtol=1e-10)


def test_entropy_is_a_detached_metric(model64) -> None:
    ids, mask = _batch()
    logps, entropy = completion_logps(model64, ids, mask, T, chunk_size=4, with_entropy=True)
    assert logps.requires_grad and entropy is not None and not entropy.requires_grad


def test_float32_model_matches_naive(tiny_model: dict) -> None:
    model, _ = load_model(tiny_model, dtype="float32", seed=2)
    ids, mask = _batch(1)
    logps, entropy = completion_logps(model, ids, mask, T, chunk_size=3)
    ref, _ = _naive(model, ids, mask, 1.0)
    assert entropy is None and logps.dtype == torch.float32
    torch.testing.assert_close(_real(logps, mask), _real(ref, mask), atol=1e-5, rtol=1e-5)


def test_no_grad_gives_the_same_values_without_a_graph(model64) -> None:
    ids, mask = _batch()
    with torch.no_grad():
        logps, _ = completion_logps(model64, ids, mask, T, chunk_size=4)
    ref, _ = _naive(model64, ids, mask, 1.0)
    assert not logps.requires_grad
    torch.testing.assert_close(_real(logps, mask), _real(ref.detach(), mask), atol=1e-12, rtol=1e-10)


def test_left_padding_does_not_change_a_rows_logps(model64) -> None:
    ids, _ = _batch()
    row = ids[2:3]
    padded = torch.cat([torch.zeros(1, 4, dtype=ids.dtype), row], dim=1)
    padded_mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(row)], dim=1)
    with torch.no_grad():
        plain, _ = completion_logps(model64, row, torch.ones_like(row), T)
        shifted, _ = completion_logps(model64, padded, padded_mask, T)
    torch.testing.assert_close(plain, shifted, atol=1e-10, rtol=1e-10)


def test_lora_model_gradients_reach_the_adapters_and_match_naive(tiny_model: dict) -> None:
    model, _ = load_model(tiny_model, dtype="float32", lora={"r": 4, "lora_alpha": 8}, seed=3)
    model = model.double()
    with torch.no_grad():  # make lora_B non-zero so that every adapter gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids, mask = _batch(2)
    logps, _ = completion_logps(model, ids, mask, T, temperature=1.3, chunk_size=2)
    _real(logps, mask).sum().backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ref, _ = _naive(model, ids, mask, 1.3)
    _real(ref, mask).sum().backward()
    slow = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert fast.keys() == slow.keys() and all("lora_" in n for n in fast)
    torch.testing.assert_close(_real(logps, mask), _real(ref, mask), atol=1e-12, rtol=1e-10)
    for name in fast:
        torch.testing.assert_close(fast[name], slow[name], atol=1e-12, rtol=1e-10)


def test_logits_are_formed_one_chunk_at_a_time_forward_and_backward(model64) -> None:
    """The memory claim: the head only ever sees chunk_size rows, and nothing of vocabulary
    width is kept for backward outside the per-chunk recomputation."""
    vocab = tiny_vocab_size()
    ids, mask = _batch()
    head = model64.get_output_embeddings()
    rows_seen: list[int] = []
    hook = head.register_forward_hook(lambda mod, inp, out: rows_seen.append(out.reshape(-1, vocab).shape[0]))
    saved_vocab_sized: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 1 and t.shape[-1] == vocab:
            saved_vocab_sized.append(tuple(t.shape))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logps, _ = completion_logps(model64, ids, mask, T, chunk_size=4, with_entropy=True)
        forward_calls = len(rows_seen)
        logps.sum().backward()
    finally:
        hook.remove()
    n_chunks = -(-B * T // 4)
    assert forward_calls == n_chunks
    assert len(rows_seen) == 2 * n_chunks  # each chunk recomputed once in backward
    assert max(rows_seen) == 4
    # Only the head weight (V, H) itself may be saved: no (rows, V) logits outside the chunks.
    assert all(shape[0] <= 4 or shape == tuple(head.weight.shape) for shape in saved_vocab_sized)
    assert (B * T, vocab) not in saved_vocab_sized and (B, T, vocab) not in saved_vocab_sized


def test_temperature_and_softcapping_are_applied_like_sampling() -> None:
    class Cfg:
        final_logit_softcapping = 5.0

    class LM:
        config = Cfg()

    logits = torch.tensor([[8.0, -3.0, 1.0]], dtype=torch.float64)
    out = _logit_transform(LM(), temperature=0.5)(logits)
    torch.testing.assert_close(out, torch.tanh(logits / 5.0) * 5.0 / 0.5)


def test_model_softcapping_matches_the_models_own_logits() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = tiny_model_config("llama")
    cfg.update(architectures=["Gemma2ForCausalLM"], head_dim=8, final_logit_softcapping=2.0)
    cfg.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma2", **cfg)).double()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(50)  # large logits, so that the cap matters
    ids, _ = _batch()
    mask = torch.ones_like(ids)  # Gemma2's eager attention turns fully padded rows into NaN
    with torch.no_grad():
        logps, _ = completion_logps(model, ids, mask, T, temperature=0.8)
        ref, _ = _naive(model, ids, mask, 0.8)
        model.config.final_logit_softcapping = None
        uncapped, _ = completion_logps(model, ids, mask, T, temperature=0.8)
    torch.testing.assert_close(logps, ref, atol=1e-10, rtol=1e-10)
    assert (logps - uncapped).abs().max() > 0.1  # the cap matters at these logits


def test_ddp_wrapped_model_runs_through_the_wrappers_forward(tiny_model: dict, tmp_path) -> None:
    import torch.distributed as dist

    model, _ = load_model(tiny_model, dtype="float32", seed=4)
    model = model.double()
    ids, mask = _batch()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        logps, _ = completion_logps(ddp, ids, mask, T, chunk_size=4)
        _real(logps, mask).sum().backward()
        fast = _grads(model)
        assert "forward" not in model.__dict__  # the inner forward was restored
        ref, _ = _naive(model, ids, mask, 1.0)
        _real(ref, mask).sum().backward()
        for a, b in zip(fast, _grads(model)):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    finally:
        dist.destroy_process_group()


def test_chunked_selective_logps_on_plain_tensors() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=True).double()
    hidden = torch.randn(2, 3, 6, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 3))
    logps, _ = chunked_selective_logps(hidden, targets, head, chunk_size=4)
    ref = torch.log_softmax(head(hidden), -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(logps, ref)


def test_left_aligned_moves_each_rows_tokens_to_its_start() -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [3, 4, 5, 6, 7, 8], [0, 9, 8, 0, 0, 0]])
    mask = (ids != 0).long()
    moved = left_aligned(ids, mask, completion_width=3)
    assert moved is not None
    aligned, shift = moved
    assert shift.tolist() == [2, 0, 1]
    assert aligned.tolist() == [[5, 6, 7, 0, 0, 0], [3, 4, 5, 6, 7, 8], [9, 8, 0, 0, 0, 0]]
    holed = mask.clone()
    holed[1, 3] = 0  # an unattended token between attended ones
    assert left_aligned(ids, holed, completion_width=3) is None
    assert left_aligned(ids, mask, completion_width=4) is None  # row 0 has no token before the last 4 columns


def test_the_decoder_runs_without_a_mask_and_falls_back_to_it_for_a_holed_row(model64, monkeypatch) -> None:
    seen: list[object] = []
    decoder = model64.get_decoder()
    forward = decoder.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attention_mask"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(decoder, "forward", spy)
    ids, mask = _batch()
    with torch.no_grad():
        completion_logps(model64, ids, mask, T)
        holed = mask.clone()
        holed[2, P + 1] = 0  # e.g. a masked-out token inside the completion
        logps, _ = completion_logps(model64, ids, holed, T)
    assert seen[0] is None and seen[1] is holed
    ref, _ = _naive(model64, ids, holed, 1.0)
    torch.testing.assert_close(logps, ref, atol=1e-12, rtol=1e-10)  # the masked path: every position


def test_the_mask_stays_where_no_flash_kernel_would_take_its_place(model64, monkeypatch) -> None:
    from types import SimpleNamespace

    from grpo_plugins.logprobs import _mask_free_attention_pays

    assert _mask_free_attention_pays(model64, torch.zeros(1, 3, dtype=torch.long))  # the CPU: one path
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: False)
    assert not _mask_free_attention_pays(model64, on_gpu)  # float64 weights, no autocast
    model64.to(torch.bfloat16)  # in place
    assert _mask_free_attention_pays(model64, on_gpu)
    capability[0] = (7, 5)  # before Ampere: no flash kernel
    assert not _mask_free_attention_pays(model64, on_gpu)
    capability[0] = (8, 0)
    model64.float()
    assert not _mask_free_attention_pays(model64, on_gpu)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type=None: torch.bfloat16)
    assert _mask_free_attention_pays(model64, on_gpu)  # float32 weights under bf16 autocast
