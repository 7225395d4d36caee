"""The TRL 1.16 settings the engine carries out: the entropy bonus and its adaptive control (with
exact resume), top_entropy_quantile, sync_ref_model, disable_dropout, cast_lm_head_to_fp32,
shuffle_dataset, chat_template_kwargs, generation_kwargs, pad_to_multiple_of and printed
completions. Tiny random models on the CPU."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_plugins.config import load_config
from grpo_plugins.engine import Engine
from grpo_plugins.metrics import read_metrics
from grpo_plugins.models import load_model

PROMPTS = [{"prompt": p} for p in ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]]


def char_sum(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _config(tiny_model: dict, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    base = {
        "model": tiny_model, "task": None, "output_dir": str(tmp_path / "out"), "max_steps": 2,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "steps_per_generation": 2,
        "num_generations": 4, "max_completion_length": 6, "learning_rate": 1e-2, "report_to": ["jsonl"],
        "seed": 0,
    }
    base.update(overrides)
    return base


def _train(tiny_model: dict, tmp_path: Path, resume: bool = False, **overrides: Any) -> Engine:
    model, tok = load_model(tiny_model, dtype="float32", seed=0)
    engine = Engine(_config(tiny_model, tmp_path, **overrides), model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS)
    engine.train(resume=resume or None)
    return engine


def test_adaptive_entropy_raises_the_coefficient_while_entropy_is_below_target(tiny_model: dict, tmp_path: Path):
    _train(tiny_model, tmp_path, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=100.0,
           entropy_coef_delta=0.005, entropy_coef_max=0.018, top_entropy_quantile=0.5)
    records = read_metrics(tmp_path / "out")
    # Each step measures entropy <= 100, so the coefficient rises by 0.005, capped at 0.018.
    assert [r["entropy_coef"] for r in records] == pytest.approx([0.015, 0.018])
    assert all(0 < r["entropy_bonus/entropy"] < 100 for r in records)


def test_adaptive_entropy_lowers_the_coefficient_above_target(tiny_model: dict, tmp_path: Path):
    _train(tiny_model, tmp_path, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.0,
           entropy_coef_delta=0.004, entropy_coef_min=0.003)
    assert [r["entropy_coef"] for r in read_metrics(tmp_path / "out")] == pytest.approx([0.006, 0.003])


def test_the_entropy_bonus_changes_the_update(tiny_model: dict, tmp_path: Path):
    plain = _train(tiny_model, tmp_path / "a")
    bonus = _train(tiny_model, tmp_path / "b", entropy_coef=0.5)
    a = dict(plain.unwrapped.named_parameters())
    assert any(not torch.equal(a[n], p) for n, p in bonus.unwrapped.named_parameters())


def test_adaptive_entropy_state_resumes_exactly(tiny_model: dict, tmp_path: Path):
    settings = dict(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=100.0, entropy_coef_delta=0.005,
                    save_steps=1, steps_per_generation=1, lr_scheduler_type="constant")  # same LR whatever max_steps
    whole = _train(tiny_model, tmp_path / "whole", max_steps=3, **settings)
    _train(tiny_model, tmp_path / "split", max_steps=2, **settings)
    resumed = _train(tiny_model, tmp_path / "split", max_steps=3, resume=True, **settings)
    assert resumed.update.entropy.state_dict() == whole.update.entropy.state_dict()
    w = dict(whole.unwrapped.named_parameters())
    for name, p in resumed.unwrapped.named_parameters():
        torch.testing.assert_close(p, w[name], rtol=0, atol=0)


def test_sync_ref_model_mixes_the_policy_into_the_reference(tiny_model: dict, tmp_path: Path):
    model, tok = load_model(tiny_model, dtype="float32", seed=0)
    start = copy.deepcopy(model.state_dict())
    engine = Engine(_config(tiny_model, tmp_path, beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=0.25,
                            ref_model_sync_steps=1, max_steps=1, steps_per_generation=1),
                    model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS)
    engine.train()
    policy = engine.unwrapped.state_dict()
    for name, ref in engine.ref_model.state_dict().items():
        expected = 0.25 * policy[name] + 0.75 * start[name]
        torch.testing.assert_close(ref, expected, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(engine.ref_model.state_dict()[n], start[n]) for n in start)


def test_disable_dropout_sets_every_dropout_to_zero(tiny_model: dict, tmp_path: Path):
    model, tok = load_model(tiny_model, dtype="float32", seed=0, lora={"r": 4, "lora_dropout": 0.3})
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and any(m.p > 0 for m in dropouts)
    Engine(_config(tiny_model, tmp_path, disable_dropout=True, max_steps=1, lora={"r": 4, "lora_dropout": 0.3}),
           model=model, tokenizer=tok, rewards=[char_sum], dataset=PROMPTS).train()
    assert all(m.p == 0.0 for m in dropouts)


def test_cast_lm_head_to_fp32_keeps_a_float32_head_in_a_bfloat16_model(tiny_model: dict, tmp_path: Path):
    from grpo_plugins.models import cast_lm_head_to_fp32

    model, _ = load_model(tiny_model, dtype="bfloat16", seed=0)
    cast_lm_head_to_fp32(model)
    head = model.get_output_embeddings()
    assert head.weight.dtype == torch.float32
    hidden = torch.randn(2, model.config.hidden_size, dtype=torch.bfloat16)
    assert head(hidden).dtype == torch.float32
    ids = torch.tensor([[1, 2, 3]])
    assert model.get_input_embeddings()(ids).dtype == torch.bfloat16  # tied or not: the trunk stays bf16


def test_cast_lm_head_to_fp32_trains(tiny_model: dict, tmp_path: Path):
    engine = _train(tiny_model, tmp_path, cast_lm_head_to_fp32=True, max_steps=1)
    assert engine.unwrapped.get_output_embeddings().weight.dtype == torch.float32


def test_shuffle_dataset_false_keeps_the_dataset_order(tiny_model: dict, tmp_path: Path):
    seen: list[str] = []

    def recording(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        seen.extend(prompts)
        return char_sum(completions)

    model, tok = load_model(tiny_model, dtype="float32", seed=0)
    Engine(_config(tiny_model, tmp_path, shuffle_dataset=False, max_steps=2, steps_per_generation=1),
           model=model, tokenizer=tok, rewards=[recording], dataset=PROMPTS).train()
    assert seen == ["ab"] * 4 + ["cd"] * 4


def test_chat_template_kwargs_reach_apply_chat_template():
    from grpo_plugins.data import encode_prompts

    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            self.kwargs = kwargs
            return "hi"

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1, 2]}

    tok = Tok()
    encode_prompts(tok, [[{"role": "user", "content": "q"}]], max_prompt_length=None,
                   chat_template_kwargs={"enable_thinking": False})
    assert tok.kwargs == {"enable_thinking": False}


def test_generation_kwargs_reach_the_transformers_generator_and_are_refused_by_static(tiny_model: dict, caplog):
    from grpo_plugins.errors import GRPOPluginsError
    from grpo_plugins.generators import build_generator
    from grpo_plugins.registry import get_registry

    model, tok = load_model(tiny_model, dtype="float32", seed=0)
    config = load_config({"model": tiny_model, "generation_kwargs": {"suppress_tokens": [5], "top_p": 0.9}})
    with caplog.at_level("WARNING", logger="grpo_plugins.generators"):
        gen = build_generator(config, get_registry(), model, tok, torch.device("cpu"))
    assert type(gen).__name__ == "TransformersGenerator"  # the default, static, takes no generation_kwargs
    assert "generates with 'transformers'" in caplog.text
    assert gen.generation_config(model).suppress_tokens == [5]
    assert gen.sampling.top_p == 0.9  # moved to its own key, so the sampling log-probs know it
    static = load_config({"model": tiny_model, "generator": "static", "generation_kwargs": {"suppress_tokens": [5]}})
    with pytest.raises(GRPOPluginsError, match="not supported by the 'static' generator"):
        build_generator(static, get_registry(), model, tok, torch.device("cpu"))


def test_pad_to_multiple_of_pads_the_training_inputs(tiny_model: dict, tmp_path: Path):
    engine = _train(tiny_model, tmp_path, pad_to_multiple_of=16, max_steps=1)
    assert engine.rollouts.policy.multiple == 16


def test_printed_completions_respect_the_limit_and_unique_prompts(capsys):
    from grpo_plugins.console import print_completions

    records = [{"prompt": p, "completion": f"c{i}", "rewards": {"r": 1.0}, "advantage": 0.0}
               for i, p in enumerate(["a", "a", "b", "b", "c"])]
    assert [r["completion"] for r in print_completions(records, 2, unique_prompts=True)] == ["c0", "c2"]
    assert [r["completion"] for r in print_completions(records, 3)] == ["c0", "c1", "c2"]
    assert "c2" in capsys.readouterr().err


def test_a_synced_reference_resumes_exactly(tiny_model: dict, tmp_path: Path):
    settings = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, save_steps=1, steps_per_generation=1,
                    lr_scheduler_type="constant")
    whole = _train(tiny_model, tmp_path / "whole", max_steps=3, **settings)
    _train(tiny_model, tmp_path / "split", max_steps=2, **settings)
    resumed = _train(tiny_model, tmp_path / "split", max_steps=3, resume=True, **settings)
    w = whole.ref_model.state_dict()
    for name, p in resumed.ref_model.state_dict().items():
        torch.testing.assert_close(p, w[name], rtol=0, atol=0)


def test_model_init_kwargs_reach_from_pretrained(tiny_model: dict, tmp_path: Path):
    model, tok = load_model(tiny_model, dtype="float32", seed=0)
    model.save_pretrained(tmp_path / "saved")
    tok.save_pretrained(tmp_path / "saved")
    config = load_config({"model": str(tmp_path / "saved"), "model_init_kwargs": {"output_attentions": True, "dtype": "float32"}})
    assert config.model.init_kwargs == {"output_attentions": True}
    loaded, _ = load_model(config.model, dtype=config.dtype)
    assert loaded.config.output_attentions is True


# -- the sampler's log-probs reach every piece that reads them ------------------------------------

SAMPLER_OFFSET = 0.05


@pytest.fixture()
def offset_sampler():
    """A generator that stands in for vLLM on the CPU: it samples with the policy but is not
    the policy (``samples_from_policy = False``) and reports log-probs 0.05 above the policy's,
    so KL(sampler || policy) is about 0.05 per token."""
    from grpo_plugins.generators.transformers_backend import TransformersGenerator
    from grpo_plugins.registry import get_registry

    class OffsetSampler(TransformersGenerator):
        samples_from_policy = False

        def generate(self, prompt_ids):
            out = super().generate(prompt_ids)
            out.sampling_logps = out.sampling_logps + SAMPLER_OFFSET * out.completion_mask
            return out

    get_registry().register("generator", "offset_sampler", OffsetSampler)
    yield "offset_sampler"
    get_registry().unregister("generator", "offset_sampler")


def _recording_compute_loss(monkeypatch) -> list[dict]:
    import grpo_plugins.objective as objective

    calls: list[dict] = []
    real = objective.compute_loss

    def recording(*args, **kwargs):
        calls.append({"sampling": kwargs.get("sampling_per_token_logps"),
                      "correction": kwargs["objective"].vllm_importance_sampling_correction})
        return real(*args, **kwargs)

    monkeypatch.setattr(objective, "compute_loss", recording)
    return calls


def test_a_sampler_that_is_not_the_policy_feeds_the_off_policy_mask_without_the_correction(
    tiny_model: dict, tmp_path: Path, offset_sampler: str, monkeypatch
):
    # As TRL with vLLM: the mask compares the policy with the sampler even with the correction
    # off. With the old policy's log-probs (on-policy: KL 0) it would drop nothing here.
    settings = dict(generator=offset_sampler, vllm_importance_sampling_correction=False, max_steps=1,
                    steps_per_generation=1)
    calls = _recording_compute_loss(monkeypatch)
    masked = _train(tiny_model, tmp_path / "masked", off_policy_mask_threshold=0.01, **settings)
    assert calls and all(c["sampling"] is not None and c["correction"] is False for c in calls)
    plain = _train(tiny_model, tmp_path / "plain", **settings)
    p = dict(plain.unwrapped.named_parameters())
    assert any(not torch.equal(p[n], q) for n, q in masked.unwrapped.named_parameters())
    record = read_metrics(tmp_path / "masked" / "out")[0]
    assert record["sampling/sampling_logp_difference/mean"] == pytest.approx(SAMPLER_OFFSET, abs=2e-3)
    assert record["sampling/sampling_logp_difference/max"] >= record["sampling/sampling_logp_difference/mean"]
    assert not any(k.startswith("sampling/importance_sampling_ratio") for k in record)


def test_a_sampler_that_is_not_the_policy_turns_auto_correction_on(tiny_model: dict, tmp_path: Path, offset_sampler: str):
    _train(tiny_model, tmp_path, generator=offset_sampler, max_steps=1, steps_per_generation=1)
    record = read_metrics(tmp_path / "out")[0]
    # ρ = exp(old - sampler) = exp(-0.05) per token, under the cap.
    assert record["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(-SAMPLER_OFFSET), abs=2e-3)
    assert record["sampling/sampling_logp_difference/mean"] == pytest.approx(SAMPLER_OFFSET, abs=2e-3)


def test_the_policys_own_sampler_keeps_no_sampler_log_probs(tiny_model: dict, tmp_path: Path, monkeypatch):
    # The transformers generator samples from the policy: the mask uses the old log-probs (TRL
    # without vLLM) and there is no gap to log.
    calls = _recording_compute_loss(monkeypatch)
    _train(tiny_model, tmp_path, off_policy_mask_threshold=0.01, max_steps=1, steps_per_generation=1)
    assert calls and all(c["sampling"] is None for c in calls)
    assert not any(k.startswith("sampling/") for k in read_metrics(tmp_path / "out")[0])
