"""The static generator's persistent decode layer (``persistent_layers``): its phases sample what
the decode layer samples (Triton's interpreter runs programs one after another, where a grid
barrier would wait forever, so the phases run as separate launches here), the work plans,
compilation for an sm_90 GPU with its barriers, and the setting's errors on a machine that
cannot run it."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from decode_scripts import SAME_SAMPLES, TINY_MODEL
from grpo_plugins.errors import GRPOPluginsError
from triton_compile import compile_for_hopper, run_interpreted

DECODE = """
import functools, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from grpo_plugins.generators import persistent_layer
from grpo_plugins.generators.persistent_layer import persistent_decode_head, persistent_decode_layer
from grpo_plugins.generators.static_decode import StaticDecoder, decode_step
from grpo_plugins.kinds import SamplingSettings

persistent_layer.PROGRAMS = 3  # fewer programs than items: every program takes several
""" + TINY_MODEL + """
results = []
for block_k in (None, 64, 32):  # 32-deep blocks: the 64-wide model's K in two parts, so that q/k/v is split
    dec = StaticDecoder(model, SamplingSettings(max_completion_length=6, temperature=1.0), eos_ids=[0], pad_id=0,
                        compile=False, stop_at_eos=False, merge_weights=True)
    if block_k is not None:
        persistent_layer.BLOCK_K = block_k
        dec._compiled_step = functools.partial(
            decode_step, layer_fn=functools.partial(persistent_decode_layer, phases=True), head_fn=persistent_decode_head
        )
    torch.manual_seed(4)
    results.append(dec.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]]))
# The generator's own path: the step the setting selects, its head compiled (aot_eager on the CPU).
from grpo_plugins.generators import static_decode
static_decode.use_persistent_layers = lambda parts, rows, wanted: wanted is True  # the CPU has no CUDA device
static_decode.persistent_decode_layer = functools.partial(persistent_decode_layer, phases=True)
dec = StaticDecoder(model, SamplingSettings(max_completion_length=6, temperature=1.0), eos_ids=[0], pad_id=0,
                    compile=True, compile_backend="aot_eager", stop_at_eos=False, merge_weights=True, persistent_layers=True)
torch.manual_seed(4)
results.append(dec.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]]))
assert dec._persistent_step is not None and dec._compiled_step is None
c = model.config
hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
nqkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
splits = [persistent_layer.layer_plan(3, 64, c.num_attention_heads * hd, nqkv, c.intermediate_size, 3, True, k)["qkv"]["splits"] for k in (64, 32)]
assert splits[0] == 1 and splits[1] > 1, splits  # whole q/k/v, then partial sums
""" + SAME_SAMPLES


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # q/k/v with and without a bias
def test_the_phases_sample_what_the_decode_layer_samples(arch: str) -> None:
    run_interpreted(DECODE, arch)


@pytest.mark.parametrize("shape", [(896, 896, 1152, 4864), (1536, 1536, 2048, 8960)])  # Qwen2.5 0.5B, 1.5B
def test_every_phase_has_at_most_one_item_per_program_and_covers_its_weight(shape: tuple[int, int, int, int]) -> None:
    from grpo_plugins.generators.persistent_layer import layer_plan

    H, QD, NQKV, I = shape
    plan = layer_plan(64, H, QD, NQKV, I, 132)
    for name, (N, K) in {"qkv": (NQKV, H), "o": (H, QD), "gate_up": (I, H), "down": (H, I)}.items():
        items = plan[name]
        assert items["groups"] * items["splits"] <= 132, name
        assert items["rows"] <= items["block_n"] <= 128, name
        covered = set()
        for g in range(items["groups"]):
            covered.update(range(g * items["rows"], min(N, (g + 1) * items["rows"])))
        assert covered == set(range(N)), name
        if items["splits"] > 1:  # the parts of K are whole blocks and cover K
            assert items["k_per_split"] % 64 == 0 and (items["splits"] - 1) * items["k_per_split"] < K <= items["splits"] * items["k_per_split"]
    assert plan["qkv"]["splits"] > 1  # q/k/v as partial sums: each program reads a slice of the input
    if H == 1536:  # gate/up: 132 equal ranges of 68 rows (in 128-row tiles) where 64-row tiles would be 140 items
        assert (plan["gate_up"]["rows"], plan["gate_up"]["groups"]) == (68, 132)
    with pytest.raises(ValueError, match="fits 8 programs in tiles of at most 128 rows"):  # 128-row tiles cannot hold a 7B layer on 8 programs
        layer_plan(64, 3584, 3584, 4608, 18944, 8)


def test_a_step_of_128_rows_takes_tiles_half_as_tall() -> None:
    from grpo_plugins.generators.persistent_layer import layer_plan

    small = layer_plan(128, 576, 576, 960, 1536, 132)  # SmolLM2-135M (the GPU example decodes 128 rows)
    assert max(items["block_n"] for items in small.values()) <= 64
    with pytest.raises(ValueError, match="128 rows a step allow tiles of at most 64 weight rows"):
        layer_plan(128, 1536, 1536, 2048, 8960, 132)  # 1.5B's gate/up needs 68-row ranges
    assert layer_plan(64, 1536, 1536, 2048, 8960, 132)["gate_up"]["block_n"] == 128


def test_the_kernel_compiles_for_hopper_with_bounded_barriers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from grpo_plugins.generators import persistent_kernels as pk

    kernel = pk.layer_kernel
    pointers = {name: "*bf16" for name in kernel.arg_names if name.endswith("_ptr")}
    pointers.update(pending_ptr="*fp32", o_parts_ptr="*fp32", down_parts_ptr="*fp32", index_ptr="*i64", bias_ptr="*fp32", sync_ptr="*i64", times_ptr="*i64")
    signature = {name: pointers.get(name, "fp32" if name in ("eps1", "eps2", "scale") else "i32") for name in kernel.arg_names}
    for only, times, rows in ((-1, False, 64), (-1, True, 64), (5, False, 64), (-1, False, 128)):
        tile = 8192 // rows  # the tallest weight tile beside this many step rows
        constants = dict(NPROG=132, ONLY=only, BLOCK_M=rows, BLOCK_H=2048, BN_QKV=16, BN_O=64, BN_GU=tile, BN_D=tile, BLOCK_K=64,
                         HKV=2, G=6, GP=16, D=128, BLOCK_W=64, QKV_BIAS=True, GU_BIAS=False,
                         PENDING_SPLITS=10, O_SPLITS=4, TIMES=times, QKV_SPLITS=4 if times else 1, BLOCK_QG=1024, SPIN=pk.SPIN_LIMIT)
        ptx = str(compile_for_hopper(kernel, signature, constants)["ptx"])
        # six barriers: one acquire-release arrival each, the spin's acquire loads, the gave-up flag
        assert ptx.count("atom.global.gpu.acq_rel.add") == (6 if only < 0 else 0)
        assert ptx.count("ld.global.gpu.acquire") == (6 if only < 0 else 0)
        assert ptx.count("atom.global.gpu.acq_rel.max.s64") == (6 if only < 0 else 0)
        assert ptx.count(str(pk.SPIN_LIMIT)) == (6 if only < 0 else 0)  # each spin's bound
        assert ("%globaltimer" in ptx) == times


CHECK = """
import functools, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from grpo_plugins.generators import persistent_layer as pl
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.kinds import SamplingSettings
""" + TINY_MODEL + """
dec = StaticDecoder(model, SamplingSettings(max_completion_length=3), eos_ids=[0], pad_id=0, compile=False, merge_weights=True)
parts = dec._decode_parts()
pl.PROGRAMS = 3
pl.persistent_layers_unsupported = lambda parts, rows: None  # the CPU has no CUDA device: check the rest
layer_fn = pl.persistent_decode_layer
pl.persistent_decode_layer = functools.partial(layer_fn, phases=True)  # the interpreter runs programs one by one
assert pl.use_persistent_layers(parts, 4, True)  # the check passes: the layer computes the torch layer's output
assert pl._FAULTS and set(pl._FAULTS.values()) == {None}

def off_by_a_little(*args, **kwargs):  # as if one norm weight were 10 % off
    h, parts_ = layer_fn(*args, phases=True, **kwargs)
    return h * 1.1, parts_

pl._FAULTS.clear()
pl.persistent_decode_layer = off_by_a_little
assert not pl.use_persistent_layers(parts, 4, None)  # auto: the torch layers
fault = next(iter(pl._FAULTS.values()))
assert fault.startswith("its layer output differs from the torch layer's by"), fault
try:
    pl._FAULTS.clear()
    pl.use_persistent_layers(parts, 4, True)
    raise AssertionError("no error")
except Exception as error:
    assert "persistent_layers cannot run here: its layer output differs" in str(error) and "set persistent_layers: false" in str(error), error
print("ok")
"""


def test_the_check_at_first_use_compares_the_kernel_with_the_torch_layer() -> None:
    run_interpreted(CHECK, "qwen2")


def _tiny_decoder(**settings: object) -> object:
    from grpo_plugins.generators.static_decode import StaticDecoder
    from grpo_plugins.kinds import SamplingSettings
    from grpo_plugins.models import load_model
    from grpo_plugins.testing.tiny import tiny_model_spec

    spec = tiny_model_spec(Path(tempfile.mkdtemp()) / "qwen2", "qwen2", hidden_size=64, intermediate_size=128)
    model, _ = load_model(spec, dtype="float32", seed=0)
    return StaticDecoder(model, SamplingSettings(max_completion_length=3), eos_ids=[0], pad_id=0, compile=False, **settings)


def test_asking_for_persistent_layers_where_they_cannot_run_is_an_error_naming_the_setting() -> None:
    with pytest.raises(GRPOPluginsError, match="persistent_layers cannot run here: it needs a CUDA device; set persistent_layers: false"):
        _tiny_decoder(persistent_layers=True, merge_weights=True).generate([[5, 6]])
    auto = _tiny_decoder(persistent_layers=None, stop_at_eos=False).generate([[5, 6]])  # auto: the torch layers where it cannot run
    assert auto[0].shape == (1, 3)


def test_a_barrier_that_gave_up_voids_the_generation_with_an_error_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_plugins.generators import persistent_layer

    cpu = torch.device("cpu")
    monkeypatch.setitem(persistent_layer._SYNC, cpu, torch.tensor([132 * 7 + 5, 1]))
    with pytest.raises(GRPOPluginsError, match=r"could not all run at once .* set persistent_layers: false"):
        persistent_layer.check_barriers(cpu)
    assert persistent_layer._SYNC[cpu].tolist() == [132 * 7 + 5, 0]  # the flag is cleared
    persistent_layer.check_barriers(cpu)  # nothing raised once cleared
