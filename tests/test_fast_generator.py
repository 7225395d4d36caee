"""The ``static`` generator (static KV cache, captured decode step) on tiny CPU models: greedy
decoding matches ``model.generate``, sampling follows the processed distribution, the filters
restrict the support exactly as transformers' warpers do, and EOS / truncation are reported as
the ``transformers`` backend reports them."""

from __future__ import annotations

import pytest
import torch

from grpo_plugins.generators.static_cache import StaticCacheGenerator
from grpo_plugins.generators.static_decode import StaticDecoder, UnsupportedModelError, process_logits, sample_tokens
from grpo_plugins.generators.static_layers import check_supported
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model
from grpo_plugins.config import GRPOConfig
from grpo_plugins.registry import Registry, get_registry

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 11, 12, 13, 14, 15, 16, 17], [1, 40]]


def _load(spec: dict) -> tuple:
    model, tokenizer = load_model(spec, dtype="float32", seed=0)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def llama(tiny_model: dict) -> tuple:
    return _load(tiny_model)


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2: dict) -> tuple:
    return _load(tiny_qwen2)


def _reference_generate(model, prompts, max_new_tokens, eos_id, pad_id=0):
    """Greedy ``model.generate`` on left-padded prompts -> (B, T) new tokens."""
    P = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts])
    mask = (ids != pad_id).long()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
    )
    return out[:, P:]


def _teacher_forced_logps(model, prompt, completion, temperature=1.0):
    """log p(completion token | prefix) from one plain forward pass, (T,)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@pytest.mark.parametrize("window_step", [128, 5])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_match_model_generate(arch: str, window_step: int, request: pytest.FixtureRequest) -> None:
    """Also with attention windows of 5 slots (five graphs, the cache read only up to the
    window holding the current token)."""
    model, _ = request.getfixturevalue(arch)
    sampling = SamplingSettings(max_completion_length=24, top_k=1)
    decoder = StaticDecoder(model, sampling, [2], 0, prompt_multiple=16, window_step=window_step)
    ids, mask, truncated, _ = decoder.generate(PROMPTS)
    reference = _reference_generate(model, PROMPTS, 24, eos_id=2)
    assert ids.shape == reference.shape
    assert torch.equal(ids, reference)


def test_attention_windows_cover_the_cache_in_steps() -> None:
    from grpo_plugins.generators.static_decode import attention_windows

    assert attention_windows(64, 1024) == [64 + 128 * j for j in range(1, 8)] + [64 + 1023]
    assert attention_windows(16, 24, 5) == [21, 26, 31, 36, 39]
    assert attention_windows(16, 100) == [115]  # shorter than one step: one window
    long = attention_windows(64, 8192)
    assert len(long) == 16 and long[-1] == 64 + 8191  # the step widens to keep 16 graphs


def test_attention_windows_sample_what_one_whole_cache_window_samples(qwen2: tuple) -> None:
    """Same seed, same tokens; log-probs equal up to float rounding of the shorter reductions."""
    model, _ = qwen2
    sampling = SamplingSettings(max_completion_length=20, temperature=0.8)
    torch.manual_seed(5)
    whole = StaticDecoder(model, sampling, [], 0, prompt_multiple=8, window_step=1000).generate(PROMPTS)
    torch.manual_seed(5)
    windowed = StaticDecoder(model, sampling, [], 0, prompt_multiple=8, window_step=3).generate(PROMPTS)
    assert torch.equal(whole[0], windowed[0])
    torch.testing.assert_close(whole[3], windowed[3], atol=1e-5, rtol=1e-5)


def test_sampling_logps_equal_a_forward_pass(qwen2: tuple) -> None:
    model, _ = qwen2
    torch.manual_seed(0)
    sampling = SamplingSettings(max_completion_length=16, temperature=0.7)
    ids, mask, _, logps = StaticDecoder(model, sampling, [], 0, prompt_multiple=8).generate(PROMPTS)
    for row, prompt in enumerate(PROMPTS):
        n = int(mask[row].sum())
        expected = _teacher_forced_logps(model, prompt, ids[row, :n].tolist(), temperature=0.7)
        torch.testing.assert_close(logps[row, :n], expected, atol=1e-4, rtol=1e-4)


def test_first_token_distribution_matches_softmax(llama: tuple) -> None:
    model, _ = llama
    torch.manual_seed(1)
    n = 6000
    sampling = SamplingSettings(max_completion_length=1, temperature=0.5)
    ids, *_ = StaticDecoder(model, sampling, [], 0, prompt_multiple=8).generate([PROMPTS[0]] * n)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    probs = (logits / 0.5).softmax(-1)
    empirical = torch.bincount(ids[:, 0], minlength=probs.numel()).float() / n
    total_variation = 0.5 * (empirical - probs).abs().sum().item()
    # E[TV] for this many samples is about 0.03 here; a wrong temperature or order gives > 0.15.
    assert total_variation < 0.07


@pytest.mark.parametrize("settings", [dict(), dict(top_k=7), dict(temperature=0.6, top_p=0.5)])
def test_two_stage_sampling_draws_each_token_with_its_softmax_probability(settings: dict) -> None:
    # 1000 logits are sampled as 50 slices of 20; top-k 7 leaves most slices empty (-inf).
    s = SamplingSettings(**settings)
    torch.manual_seed(0)
    logits = torch.randn(1, 1000) * 2
    logits[0, 500:520] += 2.5
    expected = process_logits(logits, None, s).log_softmax(-1)[0]
    n = 100_000
    tokens, logps = sample_tokens(logits.expand(n, -1).contiguous(), None, s)
    torch.testing.assert_close(logps, expected[tokens], atol=1e-5, rtol=0)
    counts = torch.bincount(tokens, minlength=1000).double()
    support = expected > float("-inf")
    assert counts[~support].sum() == 0
    # Pearson's statistic over the support: mean = dof, sd = sqrt(2 dof); a sampler that
    # ignored the slices' masses would be off by orders of magnitude.
    mean = n * expected[support].exp().double()
    dof = int(support.sum()) - 1
    chi2 = ((counts[support] - mean) ** 2 / mean).sum().item()
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10


@pytest.mark.parametrize(
    "settings",
    [
        dict(top_k=5),
        dict(top_p=0.6),
        dict(min_p=0.2),
        dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
        dict(repetition_penalty=1.3),
    ],
)
def test_filters_match_transformers_warpers(settings: dict) -> None:
    from transformers import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(2)
    s = SamplingSettings(**settings)
    logits = torch.randn(6, 50) * 3
    history = torch.randint(0, 50, (6, 7))
    seen = torch.zeros(6, 50, dtype=torch.bool).scatter(1, history, True)
    expected = logits.clone()
    warpers = [RepetitionPenaltyLogitsProcessor(s.repetition_penalty)] if s.repetition_penalty != 1 else []
    warpers += [TemperatureLogitsWarper(s.temperature)] if s.temperature != 1 else []
    warpers += [TopKLogitsWarper(s.top_k)] if s.top_k else []
    warpers += [TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []
    warpers += [MinPLogitsWarper(s.min_p)] if s.min_p else []
    for warper in warpers:
        expected = warper(history, expected)
    actual = process_logits(logits, seen, s)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    torch.testing.assert_close(actual[~torch.isinf(actual)], expected[~torch.isinf(expected)])


def test_top_k_restricts_sampled_support(qwen2: tuple) -> None:
    model, _ = qwen2
    torch.manual_seed(3)
    ids, *_ = StaticDecoder(model, SamplingSettings(max_completion_length=1, top_k=3), [], 0).generate(
        [PROMPTS[1]] * 500
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[1]])).logits[0, -1]
    assert set(ids[:, 0].tolist()) == set(logits.topk(3).indices.tolist())


def test_eos_ends_a_completion_and_truncation_is_flagged(llama: tuple) -> None:
    model, _ = llama
    greedy = SamplingSettings(max_completion_length=12, top_k=1)
    free, *_ = StaticDecoder(model, greedy, [], 0).generate(PROMPTS)
    eos = int(free[0, 3])  # make the 4th greedy token of row 0 the EOS
    ids, mask, truncated, logps = StaticDecoder(model, greedy, [eos], 0).generate(PROMPTS)
    reference = _reference_generate(model, PROMPTS, 12, eos_id=eos)
    assert torch.equal(ids, reference[:, : ids.shape[1]])
    for row in range(len(PROMPTS)):
        hits = (free[row] == eos).nonzero()
        length = int(hits[0]) + 1 if len(hits) else 12
        assert int(mask[row].sum()) == length  # EOS included
        assert bool(truncated[row]) == (len(hits) == 0)
        assert (ids[row, length:] == 0).all() and (logps[row, length:] == 0).all()
    assert int(mask[0].sum()) == 4 and not truncated[0]


def test_all_rows_finishing_early_stops_decoding(llama: tuple) -> None:
    model, _ = llama
    greedy = SamplingSettings(max_completion_length=64, top_k=1)
    free, *_ = StaticDecoder(model, greedy, [], 0).generate([PROMPTS[0]])
    eos = int(free[0, 1])
    ids, mask, truncated, _ = StaticDecoder(model, greedy, [eos], 0, check_every=1).generate([PROMPTS[0]] * 3)
    assert ids.shape == (3, 2) and mask.sum().item() == 6 and not truncated.any()


@pytest.mark.slow
def test_generator_uses_the_current_lora_weights(tiny_qwen2: dict) -> None:
    model, tokenizer = load_model(tiny_qwen2, dtype="float32", lora={"r": 4, "target_modules": "all-linear"}, seed=0)
    generator = get_registry().build("generator", "static")
    generator.setup(model, tokenizer, SamplingSettings(max_completion_length=10, top_k=1))
    before = generator.generate(PROMPTS).completion_ids
    with torch.no_grad():  # an optimizer step, in place: the adapter now changes the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    after = generator.generate(PROMPTS).completion_ids
    assert not torch.equal(before, after)
    assert torch.equal(
        after, _reference_generate(model, PROMPTS, 10, eos_id=tokenizer.eos_token_id)[:, : after.shape[1]]
    )
    model.train()  # the engine trains in train mode: generation must restore it
    generator.generate(PROMPTS)
    assert model.training


def test_output_contract_matches_the_transformers_backend(tiny_model: dict) -> None:
    model, tokenizer = _load(tiny_model)
    sampling = SamplingSettings(max_completion_length=8, top_k=1, seed=5)
    outputs = {}
    for name in ("static", "transformers"):
        generator = get_registry().build("generator", name)
        generator.setup(model, tokenizer, sampling)
        outputs[name] = generator.generate(PROMPTS)
    fast, slow = outputs["static"], outputs["transformers"]
    assert torch.equal(fast.completion_ids, slow.completion_ids)
    assert torch.equal(fast.completion_mask, slow.completion_mask)
    assert torch.equal(fast.is_truncated, slow.is_truncated)
    torch.testing.assert_close(fast.sampling_logps, slow.sampling_logps, atol=1e-5, rtol=1e-5)
    assert fast.completion_ids.dtype == torch.long and fast.completion_mask.dtype == slow.completion_mask.dtype


def test_same_seed_gives_the_same_samples(tiny_model: dict) -> None:
    model, tokenizer = _load(tiny_model)
    runs = []
    for _ in range(2):
        generator = get_registry().build("generator", "static")
        generator.setup(model, tokenizer, SamplingSettings(max_completion_length=8, seed=11))
        runs.append([generator.generate(PROMPTS).completion_ids for _ in range(2)])
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[0][1])  # the per-call counter moves the seed


def test_unsupported_model_falls_back_or_raises(tiny_model: dict) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tokenizer = _load(tiny_model)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2)).eval()
    strict = get_registry().build("generator", "static", {"fallback": False})
    with pytest.raises(UnsupportedModelError, match="generator: transformers"):
        strict.setup(gpt2, tokenizer, SamplingSettings(max_completion_length=4))
    lenient = get_registry().build("generator", "static")
    lenient.setup(gpt2, tokenizer, SamplingSettings(max_completion_length=4))
    out = lenient.generate(PROMPTS)
    assert out.completion_ids.shape[0] == len(PROMPTS) and out.sampling_logps is not None


def test_the_fallback_is_built_from_the_run_registry(tiny_model: dict) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from grpo_plugins.generators import build_generator
    from grpo_plugins.generators.transformers_backend import TransformersGenerator
    from grpo_plugins.testing import registered_component

    class RunOwnTransformers(TransformersGenerator):
        """Stands for the run registry's own 'transformers' generator."""

    _, tokenizer = _load(tiny_model)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2)).eval()
    run_registry = Registry()
    run_registry.unregister("generator", "transformers")
    with registered_component("generator", RunOwnTransformers, "transformers", registry=run_registry):
        config = GRPOConfig(generator="static", max_completion_length=4)
        generator = build_generator(config, run_registry, gpt2, tokenizer, torch.device("cpu"))
        assert type(generator._fallback) is RunOwnTransformers  # not the process-wide registry's


def test_ignore_eos_samples_the_full_length(llama: tuple) -> None:
    model, tokenizer = llama
    generator = StaticCacheGenerator(StaticCacheGenerator.Params(ignore_eos=True))
    generator.setup(model, tokenizer, SamplingSettings(max_completion_length=9))
    out = generator.generate(PROMPTS)
    assert out.completion_ids.shape == (4, 9) and out.completion_mask.all()


def test_release_cache_frees_the_graphs_and_gives_the_same_tokens(llama: tuple) -> None:
    model, _ = llama
    greedy = SamplingSettings(max_completion_length=6, top_k=1)
    kept = StaticDecoder(model, greedy, [2], 0)
    released = StaticDecoder(model, greedy, [2], 0, release_cache=True)
    for _ in range(2):
        assert torch.equal(kept.generate(PROMPTS)[0], released.generate(PROMPTS)[0])
    assert len(kept._graphs) == 1 and len(released._graphs) == 0


def test_release_cache_hands_freed_blocks_back_on_the_model_device(llama: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """With release_cache, every generate returns the freed KV cache's blocks (empty_cache on
    CUDA) so training does not reserve its own on top; without it, nothing is released."""
    import grpo_plugins.generators.static_decode as static_decode

    real = static_decode.return_freed_memory
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    real(torch.device("cpu"))
    real(torch.device("cuda", 0))
    assert emptied == [1]  # only for a CUDA device

    model, _ = llama
    seen: list[torch.device] = []
    monkeypatch.setattr(static_decode, "return_freed_memory", seen.append)
    greedy = SamplingSettings(max_completion_length=4, top_k=1)
    StaticDecoder(model, greedy, [2], 0).generate(PROMPTS)
    assert seen == []
    released = StaticDecoder(model, greedy, [2], 0, release_cache=True)
    released.generate(PROMPTS)
    released.generate(PROMPTS)
    assert seen == [torch.device("cpu")] * 2


def test_release_cache_frees_the_cache_and_merged_copies_before_handing_memory_back(
    tiny_qwen2: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """empty_cache can only return blocks nothing holds: when release_cache hands memory back,
    the KV cache and the merged LoRA copies must already be unreachable (at 7B x 16 x 8192 the
    generation's locals kept 7 GiB reserved through training)."""
    import weakref

    import grpo_plugins.generators.static_decode as static_decode

    caches: list[weakref.ref] = []
    allocate = static_decode.DecodeState.allocate

    def tracked(*args: object, **kwargs: object) -> object:
        state = allocate(*args, **kwargs)
        caches.append(weakref.ref(state.k_cache[0]))
        return state

    monkeypatch.setattr(static_decode.DecodeState, "allocate", staticmethod(tracked))
    merged: list[weakref.ref] = []
    merged_layer = static_decode.MergedLayer

    def tracked_layer(layer: object, fp8: bool = False) -> object:
        copy = merged_layer(layer, fp8)
        merged.extend(weakref.ref(b) for b in copy.buffers())
        return copy

    monkeypatch.setattr(static_decode, "MergedLayer", tracked_layer)
    decoder = StaticDecoder(_lora_qwen2(tiny_qwen2), SamplingSettings(max_completion_length=4, top_k=1), [2], 0,
                            release_cache=True, merge_weights=True)
    alive_at_release: list[int] = []

    def check(device: torch.device) -> None:
        alive_at_release.append(sum(ref() is not None for ref in caches + merged))

    monkeypatch.setattr(static_decode, "return_freed_memory", check)
    decoder.generate(PROMPTS)
    assert caches and merged and alive_at_release == [0]


@pytest.mark.parametrize("rows", [1, 3])
def test_max_batch_rows_decodes_in_parts_with_the_same_result(llama: tuple, request: pytest.FixtureRequest, rows: int) -> None:
    """Greedy decoding in parts of ``rows`` completions gives what one batch gives (ids, mask,
    truncation, log-probs), with the parts' different completion lengths padded to the longest,
    in one KV cache of ``rows`` rows."""
    model, _ = llama
    greedy = SamplingSettings(max_completion_length=6, top_k=1)
    eos = [int(StaticDecoder(model, greedy, [2], 0).generate(PROMPTS)[0][1, 0])]  # one row stops at once
    whole = StaticDecoder(model, greedy, eos, 0).generate(PROMPTS)
    allocated_rows = request.getfixturevalue("cache_rows")
    split = StaticDecoder(model, greedy, eos, 0, max_batch_rows=rows).generate(PROMPTS)
    assert whole[1].sum(1).tolist() != [6] * 4  # completions of different lengths
    for a, b in zip(whole[:3], split[:3]):
        assert torch.equal(a, b)
    torch.testing.assert_close(whole[3], split[3], atol=1e-5, rtol=1e-5)
    assert allocated_rows == [rows]  # one cache (and graph) for every part, the last one too


def test_static_params_defaults_and_typos() -> None:
    from grpo_plugins.registry import ComponentParamsError

    component = get_registry().get("generator", "static")
    params = component.validate_params({})
    assert params.compile and params.cuda_graph and not params.ignore_eos and params.fallback
    with pytest.raises(ComponentParamsError, match="compiel"):
        component.validate_params({"compiel": False})


@pytest.mark.slow
def test_compiled_decode_is_one_graph_per_function_across_layers_and_buckets(tiny_qwen2: dict) -> None:
    """Regional compilation of the decode step: a 4-layer LoRA model and two (batch, prompt)
    buckets compile exactly two graphs (a layer, the head), and sample what eager sampling does."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    from grpo_plugins.testing import tiny_model_config

    model, _ = load_model(
        {**tiny_qwen2, "config": tiny_model_config("qwen2", num_hidden_layers=4)},
        dtype="float32",
        lora={"r": 4, "target_modules": "all-linear"},
        seed=0,
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.eval()
    sampling = SamplingSettings(max_completion_length=6, temperature=0.7)
    counter = CompileCounter()
    # window_step 2: three attention windows of different widths per bucket, no recompile.
    compiled = StaticDecoder(model, sampling, [2], 0, compile=True, compile_backend=counter, prompt_multiple=4, window_step=2)
    eager = StaticDecoder(model, sampling, [2], 0, compile=False, prompt_multiple=4)
    # Buckets (3 rows, 4 columns), (5 rows, 8 columns), (7 rows, 12 columns); row counts differ
    # from every head count of the model, which dynamic shapes would otherwise unify with them.
    short, longer = [PROMPTS[1], PROMPTS[3], PROMPTS[1]], [*PROMPTS, PROMPTS[0]]
    longest = [*longer, [1, *range(20, 30)], [1, 3]]
    for prompts in (short, longer, longest, short):
        torch.manual_seed(3)
        ours = compiled.generate(prompts)
        torch.manual_seed(3)
        reference = eager.generate(prompts)
        assert torch.equal(ours[0], reference[0])
        torch.testing.assert_close(ours[3], reference[3], atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 2  # compiling whole steps took one graph per bucket
    torch._dynamo.reset()


def test_sampling_override_decodes_greedily_then_restores_the_run_settings(tiny_model: dict) -> None:
    model, tokenizer = _load(tiny_model)
    greedy = SamplingSettings(max_completion_length=8, top_k=1)
    reference = get_registry().build("generator", "transformers")
    reference.setup(model, tokenizer, greedy)
    expected = reference.generate(PROMPTS).completion_ids

    run_settings = SamplingSettings(max_completion_length=8, seed=11)
    generator = get_registry().build("generator", "static")
    generator.setup(model, tokenizer, run_settings)
    before = generator.generate(PROMPTS).completion_ids
    with generator.sampling_override(greedy):
        assert generator.sampling is greedy
        assert torch.equal(generator.generate(PROMPTS).completion_ids, expected)
    assert generator.sampling is run_settings
    generator.calls = 0  # the same seed again: the run's own decoder samples as before
    assert torch.equal(generator.generate(PROMPTS).completion_ids, before)


def _lora_qwen2(tiny_qwen2: dict) -> object:
    model, _ = load_model(tiny_qwen2, dtype="float32", lora={"r": 4, "target_modules": "all-linear"}, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


def test_merged_lora_weights_sample_what_the_adapter_modules_sample(tiny_qwen2: dict) -> None:
    """Decoding from merged, fused copies (the default for LoRA) samples the same tokens with the
    same log-probs as decoding through peft's modules, and follows in-place weight updates."""
    from grpo_plugins.generators.static_decode import MergedLayer

    model = _lora_qwen2(tiny_qwen2)
    sampling = SamplingSettings(max_completion_length=8, temperature=0.8)
    merged = StaticDecoder(model, sampling, [2], 0, prompt_multiple=4)
    modules = StaticDecoder(model, sampling, [2], 0, prompt_multiple=4, merge_weights=False)
    assert merged.merge_weights and not modules.merge_weights
    for update in range(2):
        torch.manual_seed(11)
        ours = merged.generate(PROMPTS)
        torch.manual_seed(11)
        reference = modules.generate(PROMPTS)
        assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])
        torch.testing.assert_close(ours[3], reference[3], atol=1e-5, rtol=1e-5)
        with torch.no_grad():  # an optimizer step, in place
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.mul_(-1.5)
    assert merged._merged is not None and all(isinstance(layer, MergedLayer) for layer in merged._merged)
    merged.generate(PROMPTS)  # refreshes the copy after the last update
    # The copy holds W + scaling * B @ A, fused q|k|v.
    layer, source = merged._merged[0], model.base_model.model.model.layers[0].self_attn
    q = source.q_proj
    expected_q = q.base_layer.weight + q.get_delta_weight("default")
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight[: expected_q.shape[0]], expected_q)


def test_merged_weights_are_off_for_dora_and_refused_when_forced(tiny_qwen2: dict) -> None:
    from peft import LoraConfig, get_peft_model

    base, _ = load_model(tiny_qwen2, dtype="float32", seed=0)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    sampling = SamplingSettings(max_completion_length=4)
    assert not StaticDecoder(model, sampling, [2], 0).merge_weights
    with pytest.raises(UnsupportedModelError, match="merge_weights"):
        StaticDecoder(model, sampling, [2], 0, merge_weights=True)
    plain, _ = load_model(tiny_qwen2, dtype="float32", seed=0)  # full fine-tuning: off unless asked
    assert not StaticDecoder(plain, sampling, [2], 0).merge_weights
    torch.manual_seed(1)
    fused = StaticDecoder(plain, sampling, [2], 0, merge_weights=True).generate(PROMPTS)
    torch.manual_seed(1)
    direct = StaticDecoder(plain, sampling, [2], 0).generate(PROMPTS)
    assert torch.equal(fused[0], direct[0])


def test_full_fine_tuning_decodes_from_fused_copies_when_they_are_small_next_to_the_gpu(
    tiny_qwen2: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo_plugins.generators import static_layers

    plain, _ = load_model(tiny_qwen2, dtype="float32", seed=0)
    sampling = SamplingSettings(max_completion_length=4)
    projections = sum(
        p.numel() * p.element_size()
        for name, p in plain.named_parameters()
        if any(f".{n}." in name for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    )
    assert static_layers.fused_copy_bytes(check_supported(plain)) == projections
    for memory, expected in ((None, False), (projections * 20, True), (projections * 20 - 1, False)):
        monkeypatch.setattr(static_layers, "gpu_memory", lambda device, m=memory: m)
        assert StaticDecoder(plain, sampling, [2], 0).merge_weights is expected, memory
    # Asked for explicitly, the setting wins over the rule.
    assert not StaticDecoder(plain, sampling, [2], 0, merge_weights=False).merge_weights


def test_greedy_override_of_a_lora_model_shares_the_merged_weights(tiny_qwen2: dict) -> None:
    model = _lora_qwen2(tiny_qwen2)
    _, tokenizer = _load(tiny_qwen2)
    greedy = SamplingSettings(max_completion_length=8, top_k=1)
    reference = get_registry().build("generator", "transformers")
    reference.setup(model, tokenizer, greedy)
    generator = get_registry().build("generator", "static")
    generator.setup(model, tokenizer, SamplingSettings(max_completion_length=8))
    with generator.sampling_override(greedy):
        assert torch.equal(generator.generate(PROMPTS).completion_ids, reference.generate(PROMPTS).completion_ids)
    (other,) = generator._other_decoders.values()
    assert other.merge_weights and other._merged is generator._decoder._merged


def test_memory_advice_names_the_static_settings_that_hold_memory(tiny_qwen2: dict) -> None:
    """What an out-of-memory error lists from the generator: the merged LoRA copy while it is
    kept, the KV cache outside generation while it is kept; nothing once both are off."""
    model = _lora_qwen2(tiny_qwen2)
    _, tokenizer = _load(tiny_qwen2)
    sampling = SamplingSettings(max_completion_length=4)
    default = StaticCacheGenerator()
    default.setup(model, tokenizer, sampling)
    assert [a.split(" ")[0] for a in default.memory_advice("generation")] == [
        "generator.params.merge_weights", "generator.params.max_batch_rows",
    ]
    assert [a.split(" ")[0] for a in default.memory_advice("training")] == [
        "generator.params.merge_weights", "generator.params.release_cache",
    ]
    lean = StaticCacheGenerator(StaticCacheGenerator.Params(release_cache=True, merge_weights=False, max_batch_rows=8))
    lean.setup(model, tokenizer, sampling)
    assert lean.memory_advice("generation") == [] and lean.memory_advice("training") == []


def test_repeated_prompts_are_prefilled_once_each_with_the_same_caches_and_samples(qwen2: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_plugins.generators import static_decode, static_steps

    model, _ = qwen2
    parts = check_supported(model)
    group = [PROMPTS[0]] * 3 + [PROMPTS[2]] * 3 + [PROMPTS[1]] * 2  # three prompts, 3, 3 and 2 completions
    P, L = 8, len(parts.layers)
    ids = torch.zeros(len(group), P, dtype=torch.long)
    valid = torch.zeros(len(group), P, dtype=torch.bool)
    for row, p in enumerate(group):
        ids[row, P - len(p) :] = torch.tensor(p)
        valid[row, P - len(p) :] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)

    def caches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (len(group), parts.num_kv_heads, P + 4, parts.head_dim)
        return [torch.zeros(shape) for _ in range(L)], [torch.zeros(shape) for _ in range(L)]

    rows_seen: list[int] = []
    prefill = static_steps.prefill

    def counting(parts_, input_ids, *rest):
        rows_seen.append(input_ids.shape[0])
        return prefill(parts_, input_ids, *rest)

    with torch.no_grad():
        k_all, v_all = caches()
        want = prefill(parts, ids, valid, positions, k_all, v_all)
        k_once, v_once = caches()
        monkeypatch.setattr(static_steps, "prefill", counting)
        got = static_steps.prefill_distinct(parts, ids, valid, positions, k_once, v_once)
    assert rows_seen == [3]  # the distinct prompts only
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(k_all + v_all, k_once + v_once):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(static_steps, "prefill", prefill)

    # The whole decoder: the same samples as with every row prefilled.
    sampling = SamplingSettings(max_completion_length=6, temperature=1.0)
    torch.manual_seed(5)
    once = StaticDecoder(model, sampling, [2], 0, prompt_multiple=4).generate(group)
    monkeypatch.setattr(static_decode, "prefill_distinct", prefill)
    torch.manual_seed(5)
    every = StaticDecoder(model, sampling, [2], 0, prompt_multiple=4).generate(group)
    assert torch.equal(once[0], every[0]) and torch.equal(once[1], every[1])
    torch.testing.assert_close(once[3], every[3], rtol=1e-5, atol=1e-5)
