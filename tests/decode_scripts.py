"""Pieces of the scripts that the decode-kernel tests run under Triton's interpreter."""

#: A tiny random model (``sys.argv[2]``: its architecture) whose biases and norm weights are
#: moved off 0 and 1, where dropping one would not show; needs sys, tempfile, Path and torch.
TINY_MODEL = """
from grpo_plugins.models import load_model
from grpo_plugins.testing.tiny import tiny_model_spec

spec = tiny_model_spec(Path(tempfile.mkdtemp()) / sys.argv[2], sys.argv[2], hidden_size=64, intermediate_size=128)
model, _ = load_model(spec, dtype="float32", seed=0)
with torch.no_grad():
    for name, p in model.named_parameters():
        if "bias" in name or "norm" in name:
            p.add_(torch.randn_like(p) * 0.3)
"""

#: Every later entry of ``results`` (generate's outputs) sampled the first one's tokens with its
#: log-probs; prints the ``ok`` the interpreter runner waits for.
SAME_SAMPLES = """
for got in results[1:]:
    assert torch.equal(got[0], results[0][0]), (results[0][0], got[0])
    torch.testing.assert_close(got[3], results[0][3], rtol=1e-5, atol=1e-5)
print("ok")
"""
