"""bench/persistent_layer.py, a decode layer as one persistent Triton kernel: its phases sample
what the decode layer samples (Triton's interpreter, which runs programs one after another, so
the phases run as separate launches there), the item plans, and compilation for an sm_90 GPU
with the grid barriers and the L2 prefetches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from triton_compile import compile_for_hopper, run_interpreted  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_scripts import SAME_SAMPLES, TINY_MODEL  # noqa: E402

DECODE = """
import sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from bench import persistent_layer
import bench.profile_decode as profile

persistent_layer.PROGRAMS = 3  # fewer programs than items: every program takes several
""" + TINY_MODEL + """
results = []
for variant in ({"merge_weights": True}, {"merge_weights": True, "persistent": True, "phases": True},
                {"merge_weights": True, "persistent": True, "phases": True, "qkv_split": True}):
    if variant.get("qkv_split"):  # 32-deep blocks: the 64-wide model's K in two parts, so that q/k/v splits
        persistent_layer.BLOCK_K = 32
        c = model.config
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        qd, nqkv = c.num_attention_heads * hd, (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
        assert persistent_layer.layer_plan(3, c.hidden_size, qd, nqkv, c.intermediate_size, 3, True, 32)["qkv"]["splits"] > 1
    dec = profile._decoder(model, 6, variant)
    torch.manual_seed(4)
    results.append(dec.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]]))
""" + SAME_SAMPLES


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # q/k/v with and without a bias
def test_the_phases_sample_what_the_decode_layer_samples(arch: str) -> None:
    run_interpreted(DECODE, arch)


@pytest.mark.parametrize("shape", [(896, 896, 1152, 4864), (1536, 1536, 2048, 8960)])  # Qwen2.5 0.5B, 1.5B
def test_every_phase_has_at_most_one_item_per_program_and_covers_its_weight(shape: tuple[int, int, int, int]) -> None:
    from bench.persistent_layer import layer_plan

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
    if H == 1536:  # gate/up: 132 equal ranges of 68 rows (in 128-row tiles) where 64-row tiles would be 140 items
        assert (plan["gate_up"]["rows"], plan["gate_up"]["groups"]) == (68, 132)


def test_the_kernel_compiles_for_hopper_with_its_barriers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from bench import persistent_layer as pl

    pointers = {name: "*bf16" for name in pl._layer_kernel.arg_names if name.endswith("_ptr")}
    pointers.update(pending_ptr="*fp32", o_parts_ptr="*fp32", down_parts_ptr="*fp32", index_ptr="*i64", bias_ptr="*fp32", sync_ptr="*i64", times_ptr="*i64")
    signature = {name: pointers.get(name, "fp32" if name in ("eps1", "eps2", "scale") else "i32") for name in pl._layer_kernel.arg_names}
    for only, prefetch, times in ((-1, 0, False), (-1, 1024, True), (5, 0, False)):
        constants = dict(NPROG=132, ONLY=only, BLOCK_M=64, BLOCK_H=2048, BN_QKV=16, BN_O=64, BN_GU=128, BN_D=128, BLOCK_K=64,
                         HKV=2, G=6, GP=16, D=128, BLOCK_W=64, QKV_BIAS=True, GU_BIAS=False, PREFETCH=prefetch,
                         PENDING_SPLITS=10, O_SPLITS=4, TIMES=times, LANES=256,
                         QKV_SPLITS=4 if times else 1, BLOCK_QG=1024)
        ptx = str(compile_for_hopper(pl._layer_kernel, signature, constants)["ptx"])
        # six barriers: one arrival each (acquire-release), the spin's acquire loads
        assert ptx.count("atom.global.gpu.acq_rel.add") == (6 if only < 0 else 0)
        assert ptx.count("ld.global.gpu.acquire") == (6 if only < 0 else 0)
        assert ("cp.async.bulk.prefetch.L2" in ptx) == (prefetch > 0)
        assert ("%globaltimer" in ptx) == times
