"""The ``transformers`` generator: shapes, EOS handling, truncation flags, sampling log-probs,
seeding, train-mode restoration; and how a run picks its generator."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from grpo_plugins.config import GRPOConfig
from grpo_plugins.data import encode_prompts, left_pad
from grpo_plugins.generators import GeneratorUnavailableError, generator_ref, vllm_available
from grpo_plugins.generators.common import unwrap_model
from grpo_plugins.generators.transformers_backend import (
    TransformersGenerator,
    TransformersGeneratorParams,
    finish_completions,
)
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.logprobs import completion_logps
from grpo_plugins.models import load_model
from grpo_plugins.registry import Registry

EOS, PAD = 2, 0
PROMPTS = ["abc", "hello world", "x", "2+2="]


@pytest.fixture()
def model_and_tokenizer(tiny_model: dict):
    return load_model(tiny_model, dtype="float32", seed=5)


def _generator(model, tokenizer, **sampling) -> TransformersGenerator:
    gen = TransformersGenerator()
    gen.setup(model, tokenizer, SamplingSettings(**{"max_completion_length": 16, "seed": 0, **sampling}))
    return gen


def _uniform_logits(model) -> None:
    """Zero the final norm: every next-token distribution is uniform, so EOS (1 in ~100) ends
    some completions within the limit and not others."""
    with torch.no_grad():
        model.get_decoder().norm.weight.zero_()


def test_finish_completions_cuts_at_the_first_eos_and_flags_truncation() -> None:
    raw = torch.tensor([[5, 6, EOS, 7, EOS], [5, 6, 7, 8, 9], [EOS, 3, 3, 3, 3]])
    ids, mask, truncated, lengths = finish_completions(raw, [EOS], PAD, max_completion_length=5)
    assert ids.tolist() == [[5, 6, EOS, PAD, PAD], [5, 6, 7, 8, 9], [EOS, PAD, PAD, PAD, PAD]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]
    assert lengths.tolist() == [3, 5, 1]


def test_finish_completions_trims_to_the_longest_kept_completion() -> None:
    raw = torch.tensor([[5, EOS, 9, 9], [EOS, 9, 9, 9]])
    ids, mask, truncated, _ = finish_completions(raw, [EOS, 3], PAD, max_completion_length=4)
    assert ids.tolist() == [[5, EOS], [EOS, PAD]]
    assert mask.tolist() == [[1, 1], [1, 0]]
    assert truncated.tolist() == [False, False]


def test_generate_returns_right_padded_completions_with_eos_in_the_mask(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    _uniform_logits(model)
    gen = _generator(model, tokenizer, max_completion_length=24)
    prompt_ids = encode_prompts(tokenizer, PROMPTS * 4, max_prompt_length=None)
    out = gen.generate(prompt_ids)

    B, T = out.completion_ids.shape
    assert B == 16 and T <= 24
    assert out.completion_mask.shape == (B, T) and out.is_truncated.shape == (B,)
    assert out.sampling_logps is not None and out.sampling_logps.shape == (B, T)
    assert out.is_truncated.any() and (~out.is_truncated).any()  # both cases occur at this seed
    for row in range(B):
        ids, mask = out.completion_ids[row], out.completion_mask[row]
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # contiguous from the start
        assert (ids[n:] == tokenizer.pad_token_id).all()
        if out.is_truncated[row]:
            assert n == 24 and EOS not in ids[:n].tolist()
        else:
            assert ids[n - 1] == EOS and EOS not in ids[: n - 1].tolist()
    # Uniform distribution over the vocabulary: every sampled token has log-prob -log(V).
    vocab = model.config.vocab_size
    valid = out.completion_mask.bool()
    torch.testing.assert_close(
        out.sampling_logps[valid], torch.full((int(valid.sum()),), -torch.log(torch.tensor(vocab * 1.0)))
    )
    assert (out.sampling_logps[~valid] == 0).all()


def test_sampling_logps_equal_the_trainers_logps_at_the_same_temperature(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    gen = _generator(model, tokenizer, temperature=0.7)
    prompt_ids = encode_prompts(tokenizer, PROMPTS, max_prompt_length=None)
    out = gen.generate(prompt_ids)

    prompts, prompt_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    ids = torch.cat([prompts, out.completion_ids], dim=1)
    mask = torch.cat([prompt_mask, out.completion_mask], dim=1)
    with torch.no_grad():
        logps, _ = completion_logps(model, ids, mask, out.completion_ids.shape[1], temperature=0.7)
    valid = out.completion_mask.bool()
    torch.testing.assert_close(out.sampling_logps[valid], logps[valid], atol=1e-4, rtol=1e-4)


def test_top_k_1_samples_the_argmax_with_probability_one(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    prompt_ids = encode_prompts(tokenizer, PROMPTS[:2], max_prompt_length=None)
    out = _generator(model, tokenizer, top_k=1, max_completion_length=6).generate(prompt_ids)
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    greedy = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=PAD, eos_token_id=EOS
    )[:, ids.shape[1] :]
    assert torch.equal(out.completion_ids[out.completion_mask.bool()], greedy[:, : out.completion_ids.shape[1]][out.completion_mask.bool()])
    torch.testing.assert_close(out.sampling_logps, torch.zeros_like(out.sampling_logps))


def test_sampling_filters_are_reflected_in_the_sampling_logps(model_and_tokenizer) -> None:
    """With top_p / min_p the processed distribution is renormalised over fewer tokens, so each
    sampled token is at least as likely as under temperature alone."""
    model, tokenizer = model_and_tokenizer
    prompt_ids = encode_prompts(tokenizer, PROMPTS, max_prompt_length=None)
    out = _generator(model, tokenizer, top_p=0.5, min_p=0.01, top_k=30).generate(prompt_ids)
    prompts, prompt_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    ids = torch.cat([prompts, out.completion_ids], 1)
    mask = torch.cat([prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        plain, _ = completion_logps(model, ids, mask, out.completion_ids.shape[1])
    valid = out.completion_mask.bool()
    assert (out.sampling_logps[valid] >= plain[valid] - 1e-5).all()
    assert (out.sampling_logps[valid] > plain[valid] + 1e-3).any()


def test_the_models_own_generation_config_does_not_filter_sampling(model_and_tokenizer) -> None:
    """A model shipped with sampling defaults (Qwen-style top_k 20, top_p 0.8, temperature 0.7)
    must still be sampled with the run's settings alone (temperature 1, no filters). The tiny
    random model's first-token distribution is close to uniform over ~100 tokens, so 128 samples
    show far more than the 20 tokens top_k 20 would allow."""
    model, tokenizer = model_and_tokenizer
    model.generation_config.do_sample = True
    model.generation_config.top_k = 20
    model.generation_config.top_p = 0.8
    model.generation_config.temperature = 0.7
    prompt_ids = encode_prompts(tokenizer, ["abc"] * 128, max_prompt_length=None)
    out = _generator(model, tokenizer, max_completion_length=1).generate(prompt_ids)
    assert out.completion_ids[:, 0].unique().numel() > 30


def test_same_seed_same_samples_next_call_differs_and_global_rng_untouched(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    prompt_ids = encode_prompts(tokenizer, PROMPTS, max_prompt_length=None)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = _generator(model, tokenizer, seed=7), _generator(model, tokenizer, seed=7)
    first_a, first_b = a.generate(prompt_ids), b.generate(prompt_ids)
    second_a = a.generate(prompt_ids)
    assert torch.equal(first_a.completion_ids, first_b.completion_ids)
    assert not torch.equal(first_a.completion_ids, second_a.completion_ids)
    assert torch.equal(torch.random.get_rng_state(), before)

    resumed = _generator(model, tokenizer, seed=7)
    resumed.load_state_dict(a.state_dict() | {"calls": 1})
    assert torch.equal(resumed.generate(prompt_ids).completion_ids, second_a.completion_ids)


def test_train_mode_restored_with_gradient_checkpointing_and_lora(tiny_model: dict) -> None:
    model, tokenizer = load_model(tiny_model, lora={"r": 4}, gradient_checkpointing=True, seed=6)
    model.train()
    gen = _generator(model, tokenizer, max_completion_length=8)
    out = gen.generate(encode_prompts(tokenizer, PROMPTS, max_prompt_length=None))
    assert model.training and all(m.training for m in model.modules())
    assert out.completion_ids.shape[0] == len(PROMPTS)
    # still trainable afterwards, with checkpointing on
    ids, mask = left_pad(encode_prompts(tokenizer, PROMPTS, max_prompt_length=None), PAD)
    logps, _ = completion_logps(model, ids, mask, 2)
    logps.sum().backward()
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)


def test_batch_size_param_splits_generation_and_pads_to_one_width(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    _uniform_logits(model)
    gen = TransformersGenerator(TransformersGeneratorParams(batch_size=3))
    gen.setup(model, tokenizer, SamplingSettings(max_completion_length=12, seed=1))
    out = gen.generate(encode_prompts(tokenizer, PROMPTS * 2, max_prompt_length=None))
    assert out.completion_ids.shape[0] == 8
    lengths = out.completion_mask.sum(1)
    assert out.completion_ids.shape[1] == int(lengths.max())
    assert ((lengths == 12) == out.is_truncated).all()


def test_unwrap_model_returns_the_same_module_from_ddp(model_and_tokenizer, tmp_path) -> None:
    import torch.distributed as dist

    model, _ = model_and_tokenizer
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert unwrap_model(torch.nn.parallel.DistributedDataParallel(model)) is model
    finally:
        dist.destroy_process_group()


# -- registration and selection ----------------------------------------------------------------


def test_generators_are_registered_through_the_entry_point() -> None:
    registry = Registry()
    assert {"transformers", "vllm"} <= set(registry.names("generator"))
    component = registry.get("generator", "transformers")
    assert component.distribution == "grpo-plugins"
    built = registry.build("generator", "transformers", {"batch_size": 4})
    assert isinstance(built, TransformersGenerator) and built.params.batch_size == 4
    assert registry.get("generator", "vllm").obj.samples_from_policy is False


def test_registering_generators_imports_no_torch() -> None:
    code = (
        "import sys; from grpo_plugins.registry import Registry; "
        "Registry().names('generator'); "
        "bad = [m for m in ('torch', 'transformers', 'datasets', 'vllm') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_generator_selection_follows_fast_inference() -> None:
    assert generator_ref(GRPOConfig()).name == "static"
    assert generator_ref(GRPOConfig(), vision=True).name == "transformers"  # only it takes images by default
    assert generator_ref(GRPOConfig(generation_kwargs={"no_repeat_ngram_size": 3})).name == "transformers"
    assert generator_ref(GRPOConfig(generator={"name": "mine", "params": {"a": 1}})).params == {"a": 1}
    if vllm_available():
        assert generator_ref(GRPOConfig(fast_inference=True)).name == "vllm"
    else:
        with pytest.raises(GeneratorUnavailableError, match="vLLM is not installed"):
            generator_ref(GRPOConfig(fast_inference=True))
