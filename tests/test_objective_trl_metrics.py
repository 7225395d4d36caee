"""compute_loss's metrics against TRL 1.16's own code, on batches with fully-masked rows and on
all-masked batches: the loss metrics against ``GRPOTrainer._compute_loss`` (clip ratios and their
per-row min / max, cispo's clip ratio, vespo's φ), the sampler metrics (importance-sampling ratio
and sampler/trainer log-prob gap) against ``GRPOTrainer._generate_and_score_completions``, and
how both combine over two processes (TRL's gathers and reduces replayed across two runs)."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from trl.trainer import grpo_trainer

from grpo_plugins.objective import LossMetrics, compute_loss

Trainer = grpo_trainer.GRPOTrainer
GA, MAX_LEN, WINDOW, EOS = 2, 7, 23, 2
LOSS_METRICS = {
    "grpo": ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max"),
    "cispo": ("cispo_clip_ratio",),
    "vespo": ("vespo/phi_seq_mean",),
}
SAMPLER_METRICS = (
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
)


class OneProcess:
    num_processes, process_index, sync_gradients = 1, 0, True
    device = torch.device("cpu")

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1) if tensor.dim() == 0 else tensor


class Recording(OneProcess):
    """The second of two processes: records what it contributes to each collective, in order."""

    num_processes = 2

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        self.calls.append(tensor.detach().clone())
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append(tensor.detach().clone())
        return super().gather(tensor)


class Replaying(OneProcess):
    """The first of two processes: each collective combines its tensor with what the recorded
    second process contributed to the same call (sum for reduce, concatenation for gather)."""

    num_processes = 2

    def __init__(self, peer: Recording) -> None:
        self.peer = iter(peer.calls)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        assert reduction == "sum"
        return tensor + next(self.peer)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        other = next(self.peer)
        as_rows = (lambda t: t.reshape(1)) if tensor.dim() == 0 else (lambda t: t)
        return torch.cat([as_rows(tensor), as_rows(other)])


def _batch(seed: int = 5, *, all_masked: bool = False, T: int = 5) -> dict:
    """Five rows: full, fully masked, three tokens, fully masked, one token (or none at all)."""
    g = torch.Generator().manual_seed(seed)
    B = 5
    lengths = [T, 0, min(3, T), 0, 1]
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    if all_masked:
        mask.zero_()
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    shift = torch.tensor([-0.5, 0.0, 0.4, 0.0, -0.3], dtype=torch.float64).unsqueeze(1)  # some rows clip as a whole
    old = logp + shift + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([0.9, -1.2, -0.3, 0.4, -0.8], dtype=torch.float64)
    return {"logp": logp, "old": old, "sampling": sampling, "adv": adv, "mask": mask}


# -- the loss metrics: GRPOTrainer._compute_loss ---------------------------------------------------


def _trl_loss_metrics(b: dict, accelerator: Any, *, loss_type: str, level: str, delta: float | None,
                      eps_high: float, is_ratio: torch.Tensor | None = None) -> dict[str, float]:
    logp = b["logp"].clone().requires_grad_(True)
    B, T = logp.shape
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type=loss_type, epsilon_low=0.2, epsilon_high=eps_high,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=GA,
                             vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0),
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=GA, accelerator=accelerator,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)}, max_completion_length=MAX_LEN,
        get_gamma_weights=Trainer.get_gamma_weights,
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": b["mask"],
        "advantages": b["adv"], "old_per_token_logps": b["old"], "num_items_in_batch": torch.tensor(float(WINDOW)),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    Trainer._compute_loss(trainer, None, inputs)
    return {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _ours(b: dict, **settings: Any) -> LossMetrics:
    _, metrics = compute_loss(
        b["logp"], b["old"], b["adv"], b["mask"], epsilon=0.2, max_completion_length=MAX_LEN,
        num_items_in_batch=WINDOW, gradient_accumulation_steps=GA, **settings,
    )
    return metrics


def _same(ours: LossMetrics | dict, theirs: dict[str, float], names: tuple[str, ...]) -> None:
    for name in names:
        assert name in theirs and name in ours, name
        want = theirs[name]
        # TRL's per-row min / max over no row at all is NaN (its log() then drops it); here it reads 0.
        want = 0.0 if math.isnan(want) else want
        assert ours[name] == pytest.approx(want, rel=1e-6, abs=1e-9), (name, ours[name], theirs[name])


CASES = [(lt, level, delta) for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo") for level in ("token", "sequence")
         for delta in (None, 1.5)]


@pytest.mark.parametrize("all_masked", [False, True])
@pytest.mark.parametrize(("loss_type", "level", "delta"), CASES)
def test_clip_ratios_and_their_row_extrema_match_trl(loss_type, level, delta, all_masked):
    b = _batch(all_masked=all_masked)
    theirs = _trl_loss_metrics(b, OneProcess(), loss_type=loss_type, level=level, delta=delta, eps_high=0.28)
    ours = _ours(b, loss_type=loss_type, importance_sampling_level=level, delta=delta, epsilon_high=0.28)
    _same(ours, theirs, LOSS_METRICS["grpo"])


def test_the_compared_batch_clips_and_counts_empty_rows():
    b = _batch()
    token = _ours(b, loss_type="dapo", epsilon_high=0.28)
    assert token["clip_ratio/high_max"] == 1.0 and 0.0 < token["clip_ratio/high_mean"] < 1.0
    # Sequence level: rows 0 (high) and 2 (low) of five clip; the two empty rows count as not clipped.
    sequence = _ours(b, loss_type="dapo", epsilon_high=0.28, importance_sampling_level="sequence")
    assert sequence["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert (sequence["clip_ratio/low_min"], sequence["clip_ratio/high_max"]) == (0.0, 1.0)


def test_row_extrema_by_hand():
    # A < 0 everywhere; ratios 0.5 are low-clipped. Token level: rows' fractions 1/2 and 1, the
    # empty row has none (left out): low_min 1/2. Sequence level the empty row counts (ratio 1): 0.
    logp = torch.log(torch.tensor([[0.5, 1.0], [0.5, 0.5], [1.0, 1.0]], dtype=torch.float64))
    old = torch.zeros_like(logp)
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    adv = -torch.ones(3, dtype=torch.float64)
    _, token = compute_loss(logp, old, adv, mask, loss_type="dapo")
    assert (token["clip_ratio/low_min"], token["clip_ratio/high_max"]) == (0.5, 0.0)
    _, sequence = compute_loss(logp, old, adv, mask, loss_type="dapo", importance_sampling_level="sequence")
    assert sequence["clip_ratio/low_min"] == 0.0
    assert sequence["clip_ratio/low_mean"] == pytest.approx(2 / 3)  # rows 0 (r = 0.71) and 1 (r = 0.5) of three


@pytest.mark.parametrize("all_masked", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_clip_ratio_matches_trl(level, all_masked):
    b = _batch(all_masked=all_masked)
    theirs = _trl_loss_metrics(b, OneProcess(), loss_type="cispo", level=level, delta=None, eps_high=1.1)
    ours = _ours(b, loss_type="cispo", importance_sampling_level=level, epsilon_high=1.1)
    _same(ours, theirs, LOSS_METRICS["cispo"])
    if all_masked and level == "sequence":  # every (empty) row has ratio 1 <= 1.1: none clipped
        assert ours["cispo_clip_ratio"] == 0.0


@pytest.mark.parametrize("all_masked", [False, True])
@pytest.mark.parametrize("correction", [None, "token_truncate"])
def test_vespo_phi_counts_every_row_as_trl(correction, all_masked):
    b = _batch(all_masked=all_masked)
    ratio = None
    settings: dict[str, Any] = {}
    if correction is not None:
        ratio = ((b["old"] - b["sampling"]) * b["mask"]).exp().clamp(max=2.0)  # TRL's token_truncate weights
        settings = {"sampling_per_token_logps": b["sampling"], "vllm_importance_sampling_correction": True,
                    "rollout_correction": correction, "vllm_importance_sampling_cap": 2.0}
    theirs = _trl_loss_metrics(b, OneProcess(), loss_type="vespo", level="token", delta=None, eps_high=0.28, is_ratio=ratio)
    ours = _ours(b, loss_type="vespo", **settings)
    _same(ours, theirs, LOSS_METRICS["vespo"])
    if all_masked:
        assert ours["vespo/phi_seq_mean"] == pytest.approx(1.0)  # φ(1) = 1 for every empty row


def test_a_one_token_batch_follows_trls_per_sequence_rule():
    # T = 1: TRL's (B, 1) test takes the clip indicators as per-sequence values over every row.
    # TRL reads the log-probs at masked positions too (here they are 0: padding at ratio 1, as
    # this project always sees it).
    b = _batch(T=1)
    b["old"] = torch.where(b["mask"].bool(), b["old"], b["logp"])
    theirs = _trl_loss_metrics(b, OneProcess(), loss_type="dapo", level="token", delta=None, eps_high=0.28)
    _same(_ours(b, loss_type="dapo", epsilon_high=0.28), theirs, LOSS_METRICS["grpo"])


# -- the sampler metrics: GRPOTrainer._generate_and_score_completions ------------------------------


def _trl_sampler_metrics(b: dict, accelerator: Any, *, mode: str, cap: float | None,
                         clip_min: float | None) -> tuple[dict[str, float], dict[str, Any]]:
    """TRL generating with vLLM: completions whose lengths and truncation give ``b['mask']``
    (a fully-masked row is a truncated completion under mask_truncated_completions)."""
    old, sampling, mask = b["old"], b["sampling"], b["mask"]
    B, T = old.shape
    truncated = [not bool(row.any()) for row in mask]
    lengths = [T if cut else int(row.sum()) for row, cut in zip(mask, truncated)]
    completion_ids = [[5] * (n - 1) + [7 if cut else EOS] for n, cut in zip(lengths, truncated)]
    sampler = [sampling[i, :n].tolist() for i, n in enumerate(lengths)]
    trainer = SimpleNamespace(
        accelerator=accelerator, model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        environment_factories=None, tools=None, environments=None,
        _generate=lambda prompts: ([[1]] * B, completion_ids, None, ["c"] * B, sampler, {}, None, None),
        _tokenizer=SimpleNamespace(pad_token_id=0), eos_token_ids=[EOS], pad_to_multiple_of=None,
        mask_truncated_completions=True,
        args=SimpleNamespace(per_device_train_batch_size=B, steps_per_generation=1, gradient_accumulation_steps=1,
                             gradient_checkpointing_kwargs=None),
        num_iterations=1, use_vllm=True, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=cap,
        vllm_importance_sampling_clip_min=clip_min,
        _get_per_token_logps_and_entropies=lambda *a, **k: (old[:, : max(lengths)], None, None), beta=0.0,
        _calculate_rewards=lambda *a: torch.zeros(B, 1), num_generations=B,
        multi_objective_aggregation="sum_then_normalize", reward_weights=torch.ones(1), scale_rewards="group",
        reward_func_names=["r"],
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [], "extra": defaultdict(list)},
        _pending_extra_logs=defaultdict(list), _pending_metrics=defaultdict(list), log_multimodal=False,
        _metrics={"train": defaultdict(list)},
    )
    out = Trainer._generate_and_score_completions(trainer, [{"prompt": "p"}] * B)
    assert torch.equal(out["completion_mask"], mask[:, : max(lengths)])
    return {k: v[-1] for k, v in trainer._metrics["train"].items()}, out


def _ours_sampler(b: dict, out: dict, *, mode: str, cap: float | None, clip_min: float | None,
                  correction: bool = True) -> LossMetrics:
    T = out["completion_mask"].shape[1]
    old = b["old"][:, :T]
    _, metrics = compute_loss(
        old.clone(), old, b["adv"], out["completion_mask"], sampling_per_token_logps=out["sampling_per_token_logps"],
        vllm_importance_sampling_correction=correction, vllm_importance_sampling_cap=cap,
        rollout_correction={"name": mode, "params": {"clip_min": clip_min}},
    )
    return metrics


MODES = [("token_truncate", 2.0, None), ("token_mask", 1.6, 0.7), ("sequence_truncate", 3.0, None),
         ("sequence_mask", 3.0, 0.5)]


@pytest.mark.parametrize("all_masked", [False, True])
@pytest.mark.parametrize(("mode", "cap", "clip_min"), MODES)
def test_the_sampler_metrics_match_trl(mode, cap, clip_min, all_masked):
    b = _batch(all_masked=all_masked)
    b["sampling"][2, 1] = float("nan")  # vLLM could not score it: no mismatch, left out of the gap
    theirs, out = _trl_sampler_metrics(b, OneProcess(), mode=mode, cap=cap, clip_min=clip_min)
    _same(_ours_sampler(b, out, mode=mode, cap=cap, clip_min=clip_min), theirs, SAMPLER_METRICS)


def test_an_all_masked_batch_logs_ratio_1_in_sequence_modes_as_trl():
    b = _batch(all_masked=True)
    theirs, out = _trl_sampler_metrics(b, OneProcess(), mode="sequence_truncate", cap=3.0, clip_min=None)
    ours = _ours_sampler(b, out, mode="sequence_truncate", cap=3.0, clip_min=None)
    for end in ("min", "mean", "max"):
        assert ours[f"sampling/importance_sampling_ratio/{end}"] == theirs[f"sampling/importance_sampling_ratio/{end}"] == 1.0


def test_the_logp_gap_is_logged_whenever_the_sampler_log_probs_are_given():
    b = _batch()
    theirs, out = _trl_sampler_metrics(b, OneProcess(), mode="token_truncate", cap=2.0, clip_min=None)
    ours = _ours_sampler(b, out, mode="token_truncate", cap=2.0, clip_min=None, correction=False)
    assert not any(name.startswith("sampling/importance_sampling_ratio") for name in ours)
    _same(ours, theirs, SAMPLER_METRICS[3:])
    m = b["mask"].bool()
    gap = (b["old"] - out["sampling_per_token_logps"].double()).abs()[m]
    assert ours["sampling/sampling_logp_difference/max"] == pytest.approx(float(gap.max()), rel=1e-6)


# -- two processes: TRL's gathers and reduces against LossMetrics.all_reduce -------------------------


def _two_processes(run: Any, first: dict, second: dict) -> dict[str, float]:
    """TRL's metrics on the first of two processes (the one that logs), the second's part of
    every collective recorded by running it first."""
    peer = Recording()
    run(second, peer)
    return run(first, Replaying(peer))


def _ours_two(first: LossMetrics, second: LossMetrics) -> LossMetrics:
    peer = Recording()
    second.all_reduce(peer)
    return first.all_reduce(Replaying(peer))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_ratios_over_two_processes_match_trl(level):
    # The second process holds only empty rows: TRL's per-row min skips them at token level.
    first, second = _batch(seed=5), _batch(seed=6, all_masked=True)
    second["mask"][0, :2] = 1

    def trl(b: dict, acc: Any) -> dict[str, float]:
        return _trl_loss_metrics(b, acc, loss_type="dapo", level=level, delta=None, eps_high=0.28)

    theirs = _two_processes(trl, first, second)
    settings = dict(loss_type="dapo", importance_sampling_level=level, epsilon_high=0.28)
    ours = _ours_two(_ours(first, **settings), _ours(second, **settings))
    _same(ours, theirs, LOSS_METRICS["grpo"])


@pytest.mark.parametrize(("mode", "cap", "clip_min"), [MODES[0], MODES[2]])
def test_sampler_metrics_over_two_processes_match_trl(mode, cap, clip_min):
    # TRL averages each process's own mean (token counts differ here: 10 and 2 active tokens).
    first, second = _batch(seed=5), _batch(seed=6, all_masked=True)
    second["mask"][0, :2] = 1
    outs = {}

    def trl(b: dict, acc: Any) -> dict[str, float]:
        metrics, outs[id(b)] = _trl_sampler_metrics(b, acc, mode=mode, cap=cap, clip_min=clip_min)
        return metrics

    theirs = _two_processes(trl, first, second)
    parts = [_ours_sampler(b, outs[id(b)], mode=mode, cap=cap, clip_min=clip_min) for b in (first, second)]
    ours = _ours_two(*parts)
    _same(ours, theirs, SAMPLER_METRICS)
    pooled = (parts[0].sums + parts[1].sums) / (parts[0].counts + parts[1].counts)
    index = ours.mean_names.index("sampling/sampling_logp_difference/mean")
    assert ours["sampling/sampling_logp_difference/mean"] != pytest.approx(float(pooled[index]))


def test_merging_micro_batches_then_processes_takes_min_of_mins_and_max_of_maxes():
    parts = [_ours(_batch(seed=s), loss_type="dapo", epsilon_high=0.28) for s in (1, 2, 3)]
    merged = LossMetrics.merge(parts)
    assert merged["clip_ratio/low_min"] == min(p["clip_ratio/low_min"] for p in parts)
    assert merged["clip_ratio/high_max"] == max(p["clip_ratio/high_max"] for p in parts)
