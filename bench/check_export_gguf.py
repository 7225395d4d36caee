"""GGUF export of a real model, checked through transformers' GGUF loader.

    python bench/check_export_gguf.py [MODEL] [--types f16 q8_0] [--dir /tmp/check_export_gguf]

Writes MODEL (default: the embedded SmolLM2-135M-Instruct) as a GGUF file of each type with
grpo_plugins.gguf_export, reads it back with ``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=...)`` and prints, per type, the file size, the largest logit error relative to the
logits' range and the fraction of positions whose argmax agrees, on a chat-formatted arithmetic
prompt; then whether the tokenizer read back from the file encodes that text to the same ids and
has the same chat template. Runs on a CPU (a few minutes for 135M parameters).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_plugins.gguf_export import write_gguf
from grpo_plugins.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--types", nargs="+", default=["f16", "q8_0"], choices=["f16", "bf16", "q8_0"])
    parser.add_argument("--dir", default="/tmp/check_export_gguf")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype="float32")
    model.eval()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    messages = [
        {"role": "system", "content": "Solve the arithmetic problem."},
        {"role": "user", "content": "What is 123 plus 4567?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text += "The answer is <answer>4690</answer>"
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        expected = model(ids).logits
    path = None
    for gguf_type in args.types:
        start = time.perf_counter()
        path = write_gguf(model, tokenizer, folder / f"model-{gguf_type}.gguf", gguf_type)
        seconds = time.perf_counter() - start
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            got = loaded(ids).logits
        error = float((got - expected).abs().max() / (expected.max() - expected.min()))
        agree = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
        print(f"{gguf_type}: {path.stat().st_size / 2**20:.1f} MiB, written in {seconds:.1f} s, "
              f"relative logit error {error:.2e}, argmax agrees at {agree:.3f} of positions", flush=True)
    assert path is not None
    back = AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    print(f"tokenizer from the GGUF: same ids {back(text)['input_ids'] == tokenizer(text)['input_ids']}, "
          f"same chat template {back.chat_template == tokenizer.chat_template}")


if __name__ == "__main__":
    main()
