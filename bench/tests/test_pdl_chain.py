"""bench/pdl_chain.py's Triton products compute x @ w.T (Triton's interpreter, float32), whole
and with K split over programs whose float32 parts a second kernel adds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

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
    out = torch.empty(64, N)
    chain.rows_product(x, w, out, 32, block_k, 3, False)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-3)
# the fewest K parts that give 132 multiprocessors a program each, in whole blocks
assert chain.swapped_split(1536, 8960, 64, 128) == 7 and chain.swapped_split(17920, 1536, 64, 128) == 1
print("ok")
"""


def test_the_chain_products_compute_x_times_w_transposed() -> None:
    pytest.importorskip("triton", reason="Triton is part of the dev extra on Linux")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
