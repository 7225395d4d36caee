"""bench/pdl_chain.py's Triton products compute x @ w.T (Triton's interpreter, float32), whole
and with K split over programs whose float32 parts a second kernel adds; its decode layer
(profile_decode's ``swapped`` and ``pdl`` variants) samples what the static generator samples."""

from __future__ import annotations

import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the core's helper for Triton's interpreter
from triton_compile import run_interpreted  # noqa: E402

SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import bench.pdl_chain as chain
torch.manual_seed(0)
# N, K, weight rows per tile, K per block; x a view with a wider row, as the chain passes it
for N, K, block_n, block_k in ((128, 256, 64, 128), (192, 128, 64, 128), (64, 512, 64, 128)):
    x, w = torch.randn(64, K + 8)[:, :K], torch.randn(N, K)
    want = x @ w.T
    out = torch.empty(64, N + 4)[:, :N]
    chain.swapped_product(x, w, out, torch.empty(16 * 64 * N), block_n, block_k, 3, False)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-3)
    bias = torch.randn(N)  # added in the product (one part) or where the parts are added
    out = torch.empty(32, N)
    chain.swapped_product(x[:32], w, out, torch.empty(16 * 32 * N), block_n, block_k, 3, False, bias)
    torch.testing.assert_close(out, want[:32] + bias, rtol=1e-4, atol=1e-3)
    out = torch.empty(64, N)
    chain.rows_product(x, w, out, 32, block_k, 3, False)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-3)
# the fewest K parts that give 132 multiprocessors a program each, in whole blocks
assert chain.swapped_split(1536, 8960, 64, 128) == 7 and chain.swapped_split(17920, 1536, 64, 128) == 1
print("ok")
"""


def test_the_chain_products_compute_x_times_w_transposed() -> None:
    run_interpreted(SCRIPT)


def test_the_swapped_decode_layer_samples_what_the_decode_layer_samples(tmp_path: Path) -> None:
    """Off a GPU its products and attention fall back to torch: this checks the layer's wiring
    (fused q/k/v split, biases, residual hand-off) against the static generator's own layer."""
    import torch

    import bench.profile_decode as profile
    from grpo_plugins.models import load_model
    from grpo_plugins.testing.tiny import tiny_model_spec

    model, _ = load_model(tiny_model_spec(tmp_path / "qwen2", "qwen2"), dtype="float32", seed=0)
    with torch.no_grad():  # biases and norm weights start at 0 and 1, where dropping one would not show
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    results = []
    for variant in ({"merge_weights": True}, {"merge_weights": True, "swapped": True, "pdl": False}, {"merge_weights": True, "swapped": True, "pdl": True}):
        torch.manual_seed(4)
        results.append(profile._decoder(model, 6, variant).generate(prompts))
    for got in results[1:]:
        assert torch.equal(got[0], results[0][0])
        torch.testing.assert_close(got[3], results[0][3], rtol=1e-5, atol=1e-5)
