"""Helpers for testing grpo-plugins and plugins written for it, with no network and no hub.

* :mod:`~grpo_plugins.testing.tiny`: :func:`build_tiny_tokenizer`, :func:`tiny_model_config`
  and :func:`tiny_model_spec` (a tiny random Llama or Qwen2 and a character-level tokenizer), :func:`build_tiny_bpe_tokenizer`
  (a small byte-level BPE tokenizer);
* :mod:`~grpo_plugins.testing.tiny_vision`: :func:`build_tiny_vlm` (a tiny random Qwen2-VL or
  Idefics3 and its offline processor), :func:`save_tiny_vlm` (the same as a ``model:`` folder)
  and :func:`tiny_image` (a small seeded random image);
* :mod:`~grpo_plugins.testing.registries`: :func:`registered_plugin`,
  :func:`registered_component` and :func:`isolated_registry` register plugins or components for
  the duration of a test and restore the registry afterwards;
* :mod:`~grpo_plugins.testing.scripted`: :class:`ScriptedGenerator`, a scripted policy (fixed
  completions) for testing environments and the engine without sampling;
* :mod:`~grpo_plugins.testing.contracts`: :func:`check_component` and :func:`check_plugin`
  check components against the interface of their kind and raise
  :class:`ComponentContractError` listing everything that is wrong (docs/plugins.md, "Testing a
  plugin"); what each kind implements is in :mod:`~grpo_plugins.testing.interfaces`, what each
  kind's behaviour check runs in :mod:`~grpo_plugins.testing.behaviour_checks`.
"""

from __future__ import annotations

from grpo_plugins.kinds import reward_interface
from grpo_plugins.testing.contracts import (
    INTERFACES,
    ComponentContractError,
    check_component,
    check_plugin,
    format_signature,
    interface_methods,
    interface_signatures,
)
from grpo_plugins.testing.registries import (
    TEST_DISTRIBUTION,
    isolated_registry,
    registered_component,
    registered_plugin,
)
from grpo_plugins.testing.scripted import ScriptedGenerator, scripted_setup
from grpo_plugins.testing.tiny import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    PAD,
    build_tiny_bpe_tokenizer,
    build_tiny_tokenizer,
    tiny_model_config,
    tiny_model_spec,
    tiny_vocab_size,
)
from grpo_plugins.testing.tiny_vision import build_tiny_vlm, save_tiny_vlm, tiny_image

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "INTERFACES",
    "PAD",
    "TEST_DISTRIBUTION",
    "ComponentContractError",
    "ScriptedGenerator",
    "build_tiny_bpe_tokenizer",
    "build_tiny_tokenizer",
    "build_tiny_vlm",
    "check_component",
    "check_plugin",
    "format_signature",
    "interface_methods",
    "interface_signatures",
    "isolated_registry",
    "registered_component",
    "registered_plugin",
    "scripted_setup",
    "reward_interface",
    "save_tiny_vlm",
    "tiny_image",
    "tiny_model_config",
    "tiny_model_spec",
    "tiny_vocab_size",
]
