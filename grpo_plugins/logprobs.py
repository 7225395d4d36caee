"""Log-probabilities of completion tokens without the full (B, T, vocab) float32 logits.

The decoder runs once; its final hidden states at the T positions that predict completion
tokens are pushed through the LM head a chunk at a time (``chunk_size`` rows x tokens per chunk),
each chunk reduced at once to the log-prob of its target token (and optionally the entropy).
With gradients enabled each chunk runs under ``torch.utils.checkpoint``, so backward recomputes
the chunk's logits instead of keeping them: neither pass holds more than one chunk of logits.
Logits are transformed exactly as when sampling: the model's own scaling / soft-capping, then
division by the temperature.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from grpo_plugins.multimodal import placeholder_token_ids

#: Computes one chunk: (hidden (N, H), targets (N,), head, transform, with_entropy) ->
#: (log-probs (N,), entropy (N,)); :func:`chunk_logps` or a compiled version of it.
ChunkFn = Callable[[Tensor, Tensor, torch.nn.Module, Callable[[Tensor], Tensor], bool], tuple[Tensor, Tensor]]

#: Wrappers whose forward must run (DDP's gradient bookkeeping, FSDP's unsharding).
_WRAPPER_TYPES: tuple[type, ...] = (
    torch.nn.parallel.DistributedDataParallel,
    torch.nn.DataParallel,
)


def _fsdp_types() -> tuple[type, ...]:
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        return (FullyShardedDataParallel, FSDPModule)
    except ImportError:  # pragma: no cover - torch built without distributed
        return ()


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counting only attended tokens, as ``generate`` computes them for left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def left_aligned(
    input_ids: Tensor, attention_mask: Tensor, completion_width: int, one_run: bool | None = None
) -> tuple[Tensor, Tensor] | None:
    """Each row's tokens moved to its start, its padding to its end: ``(ids, shift)`` with
    ``ids[b, i] = input_ids[b, i + shift[b]]``. None unless every row's attended tokens are one
    contiguous run that starts before the last ``completion_width`` columns (a prompt token
    predicts the first completion token): checked with one host sync, unless ``one_run`` says
    (the caller knows the rows' layout: :class:`~grpo_plugins.policy.RowLayout`)."""
    if one_run is False:
        return None
    att = attention_mask.bool()
    L = att.shape[1]
    first = att.int().argmax(-1)  # (B,) the first attended column
    if one_run is None:
        last = L - 1 - att.flip(-1).int().argmax(-1)  # (B,) the last
        fits = (last - first + 1 == att.sum(-1)) & (first < L - completion_width)
        if not bool(fits.all()):
            return None
    cols = (torch.arange(L, device=input_ids.device) + first[:, None]) % L  # (B, L)
    return input_ids.gather(1, cols), first


def _mask_free_attention_pays(model: Any, input_ids: Tensor) -> bool:
    """Whether the decoder should run without a padding mask: on a GPU in 16-bit, attention
    without a mask runs in the flash kernel (causal, grouped-query heads native; with a mask:
    the memory-efficient kernel, which computes the whole causal square). In float32 on a GPU
    no fused kernel takes grouped-query heads without a mask, so the mask stays; so it does on
    GPUs older than Ampere (no flash kernel)."""
    if input_ids.device.type != "cuda":
        return True  # the same kernels either way; one path, tested on the CPU
    if torch.cuda.get_device_capability(input_ids.device)[0] < 8:
        return False
    half = (torch.bfloat16, torch.float16)
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in half:
        return True
    return model.get_input_embeddings().weight.dtype in half


@contextlib.contextmanager
def _one_sequence_per_row() -> Iterator[None]:
    """Inside the block transformers' mask builder takes every row for one sequence. Without a
    padding mask it looks for packed rows (several sequences told apart by restarting positions)
    with a host synchronisation per forward, which drains the GPU's queue before every pass;
    rows moved to their start (:func:`left_aligned`) have positions 0..L-1, where its check
    finds no packing (returns None) - so the answer is known without asking the device."""
    try:
        import transformers.masking_utils as masking
    except ImportError:  # pragma: no cover - transformers without the mask builder
        yield
        return
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return
    masking.find_packed_sequence_indices = _no_packing
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find


def _no_packing(position_ids: Tensor) -> None:
    return None


def _causal_lm(model: Any) -> Any:
    """The transformers ``*ForCausalLM`` module inside a peft wrapper (or the model itself)."""
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        return model.get_base_model()
    return model


def _logit_transform(lm: Any, temperature: float) -> Callable[[Tensor], Tensor]:
    """Scaling and soft-capping the model applies to its logits, then the sampling temperature."""
    config = getattr(lm, "config", None)
    scale = getattr(lm, "logit_scale", None)  # Cohere multiplies by it
    if isinstance(scale, Tensor):
        scale = float(scale)
    divide = getattr(config, "logits_scaling", None)  # Granite divides by it
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3
    placeholders = placeholder_token_ids(config)  # a vision-language model's image tokens

    def transform(logits: Tensor) -> Tensor:
        if isinstance(scale, (int, float)) and scale != 1:
            logits = logits * scale
        if divide:
            logits = logits / divide
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if temperature != 1.0:
            logits = logits / temperature
        if placeholders:  # never sampled (see placeholder_token_ids); finite: the entropy stays a number
            index = torch.as_tensor(placeholders, device=logits.device)
            logits = logits.index_fill(-1, index, torch.finfo(logits.dtype).min)
        return logits

    # What a kernel that only divides the logits needs to know (None: it does more than that).
    only_divides = not (isinstance(scale, (int, float)) and scale != 1) and not softcap and not placeholders
    transform.divisor = float(temperature) * float(divide or 1.0) if only_divides else None  # type: ignore[attr-defined]
    return transform


def chunk_logps(
    hidden: Tensor, targets: Tensor, head: torch.nn.Module, transform: Callable[[Tensor], Tensor],
    with_entropy: bool | str,
) -> tuple[Tensor, Tensor]:
    """One chunk: hidden (N, H), targets (N,) -> log-probs (N,), entropy (N,) (zeros if off).

    ``with_entropy``: False, True (detached, a metric) or ``"grad"`` (carries the gradient: the
    entropy bonus)."""
    logits = head(hidden)  # (N, V): one chunk only
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits = transform(logits)
    logz = torch.logsumexp(logits, dim=-1)  # (N,)
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz  # (N,)
    if with_entropy == "grad":
        # The entropy bonus: the same (N, V) chunk, now with a graph (recomputed in backward).
        probs = torch.softmax(logits, dim=-1)  # (N, V)
        entropy = logz - (probs * logits).sum(-1)  # (N,)
    elif with_entropy:
        # A metric, so no graph: recomputation in backward then keeps only the logits' graph.
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)  # (N, V)
            entropy = logz - probs.mul_(logits).sum(-1)  # (N,); in place: one (N, V) temporary less
    else:
        entropy = torch.zeros_like(logps)
    return logps, entropy


def chunked_selective_logps(
    hidden: Tensor,
    targets: Tensor,
    head: torch.nn.Module,
    transform: Callable[[Tensor], Tensor] = lambda x: x,
    *,
    chunk_size: int = 1024,
    with_entropy: bool | str = False,
    chunk_fn: ChunkFn | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` under ``transform(head(hidden))``, a chunk at a time.

    Args:
        hidden: (B, T, H) final hidden states at the positions that predict ``targets``.
        targets: (B, T) token ids.
        head: the LM head (any module mapping H -> V; a LoRA-wrapped head works).
        transform: applied to each chunk's float32 logits (scaling, soft-capping, temperature).
        chunk_size: rows x tokens per chunk.
        with_entropy: also return the entropy of each position's distribution: True detached,
            ``"grad"`` carrying the gradient (the entropy bonus).
        chunk_fn: computes one chunk (default :func:`chunk_logps`; a compiled version of it
            fuses the log-softmax, gather and entropy without (N, V) temporaries).

    Returns:
        (B, T) float32 log-probs and (B, T) entropy or None.
    """
    fn = chunk_fn or chunk_logps
    if chunk_size < 1:
        raise ValueError("chunk_size must be at least 1")
    B, T, H = hidden.shape
    flat_hidden = hidden.reshape(B * T, H)  # (N, H)
    flat_targets = targets.reshape(B * T)  # (N,)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    logps, entropies = [], []
    for start in range(0, B * T, chunk_size):
        h = flat_hidden[start : start + chunk_size]
        t = flat_targets[start : start + chunk_size]
        if recompute:
            # A log-softmax draws nothing: no random state to save and restore (which would also
            # rewind the stream a generation beside training samples from, generate_ahead).
            lp, ent = checkpoint(fn, h, t, head, transform, with_entropy, use_reentrant=False, preserve_rng_state=False)
        else:
            lp, ent = fn(h, t, head, transform, with_entropy)
        logps.append(lp)
        entropies.append(ent)
    logp = torch.cat(logps).reshape(B, T) if logps else hidden.new_zeros(B, T, dtype=torch.float32)
    if not with_entropy:
        return logp, None
    entropy = torch.cat(entropies).reshape(B, T) if entropies else torch.zeros_like(logp)
    return logp, entropy


def _completion_logps_unwrapped(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    logits_to_keep: int,
    temperature: float,
    chunk_size: int,
    with_entropy: bool | str,
    chunk_fn: ChunkFn | None,
    inputs: Mapping[str, Tensor] | None = None,
    one_run: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    lm = _causal_lm(model)
    head = model.get_output_embeddings()
    aligned = None
    if inputs:
        # A vision-language model: its multimodal body merges the image features into the
        # embeddings; M-RoPE models (Qwen2-VL) compute their own 3-D positions from the mask.
        body = lm.model
        positions = None if hasattr(body, "get_rope_index") else position_ids_from_mask(attention_mask)
        out = body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **inputs
        )
    else:
        # A left-padded prompt and a right-padded completion, moved to the row's start, need no
        # padding mask: causal attention over the prefix reads real tokens only, and what the
        # trailing padding computes is never read. Same positions, same results.
        if _mask_free_attention_pays(model, input_ids):
            aligned = left_aligned(input_ids, attention_mask, logits_to_keep, one_run)
        if aligned is None:
            ids, att, positions = input_ids, attention_mask, position_ids_from_mask(attention_mask)
            out = model.get_decoder()(input_ids=ids, attention_mask=att, position_ids=positions, use_cache=False)
        else:
            ids = aligned[0]
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
            with _one_sequence_per_row():
                out = model.get_decoder()(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # (B, L, H)
    # Position i predicts token i + 1: the T completion tokens come from positions -T-1 .. -2
    # (shifted left by a row's prompt padding when its tokens were moved to the start).
    T = logits_to_keep
    if aligned is None:
        hidden = hidden[:, -T - 1 : -1]  # (B, T, H)
    else:
        B, L, H = hidden.shape
        first = torch.arange(B, device=hidden.device) * L + L - T - 1 - aligned[1]  # (B,) in (B * L) rows
        rows = (first[:, None] + torch.arange(T, device=hidden.device)).reshape(-1)  # (B * T,)
        hidden = hidden.reshape(B * L, H).index_select(0, rows).view(B, T, H)
    targets = input_ids[:, -T:]  # (B, T)
    return chunked_selective_logps(
        hidden,
        targets,
        head,
        _logit_transform(lm, temperature),
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        chunk_fn=chunk_fn,
    )


def completion_logps(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool | str = False,
    chunk_fn: ChunkFn | None = None,
    inputs: Mapping[str, Tensor] | None = None,
    one_run: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropy) of the last ``logits_to_keep`` tokens of each row.

    Args:
        model: a transformers causal LM, optionally peft-wrapped, optionally inside DDP/FSDP.
        input_ids: (B, P+T) left-padded prompt followed by the right-padded completion.
        attention_mask: (B, P+T) 1 for real tokens (prompt and completion mask).
        logits_to_keep: T, the completion length.
        temperature: the sampling temperature; logits are divided by it as when sampling.
        chunk_size: rows x tokens per chunk of the log-softmax (memory: chunk_size x vocab).
        with_entropy: also return the entropy of each position's sampling distribution:
            True detached (a metric), ``"grad"`` carrying the gradient (the entropy bonus).
        chunk_fn: computes one chunk of the log-softmax (see :func:`chunked_selective_logps`).
        inputs: a vision-language model's image inputs of the rows
            (:func:`~grpo_plugins.multimodal.collate`); empty or None for text.
        one_run: whether every row's attended tokens are one contiguous run from its prompt on,
            when the caller knows (:class:`~grpo_plugins.policy.RowLayout`); None: checked here,
            with a host synchronisation.

    Returns:
        (B, T) log-probs, and (B, T) entropy or None, in float32 (float64 for a float64 model).
        Gradients flow through the log-probs when called with grad enabled.

    Notes:
        The decoder and LM head are called directly (the full logits are never formed), so
        wrappers of the top-level ``forward`` such as accelerate's autocast are bypassed: run
        under ``accelerator.autocast()`` for mixed precision. A DDP/FSDP wrapper's own forward
        does run, with the computation substituted for the inner model's forward.
    """
    if not 1 <= logits_to_keep < input_ids.shape[1]:
        raise ValueError(
            f"logits_to_keep={logits_to_keep} must be in [1, {input_ids.shape[1]}): at least one "
            "prompt token must precede the completion"
        )
    args = (logits_to_keep, temperature, chunk_size, with_entropy, chunk_fn)
    if not isinstance(model, _WRAPPER_TYPES + _fsdp_types()):
        return _completion_logps_unwrapped(model, input_ids, attention_mask, *args, inputs, one_run)

    inner = getattr(model, "module", model)  # DDP/FSDP1 wrap the model; FSDP2 hooks it in place

    def forward(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor | None]:
        logps, entropy = _completion_logps_unwrapped(inner, input_ids, attention_mask, *args, inputs, one_run)
        # Not views: FSDP2 hooks the backward of a module's outputs, which a view would lose.
        return logps.clone(), entropy.clone() if entropy is not None else None

    # The wrapper's forward (gradient-sync bookkeeping, unsharding) calls inner(...), and FSDP2
    # runs its hooks around the model's call; swapping the inner forward for this computation
    # keeps that bookkeeping without forming logits.
    had_own = "forward" in inner.__dict__
    saved = inner.__dict__.get("forward")
    inner.forward = forward
    try:
        return model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        if had_own:
            inner.forward = saved
        else:
            del inner.forward
