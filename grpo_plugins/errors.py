"""The base class of every error a user can cause; the CLI prints these without a traceback."""

from __future__ import annotations


class GRPOPluginsError(Exception):
    """A mistake in a config, a plugin or the input data, with a message that says what to do."""


class TrainingError(GRPOPluginsError):
    """The run cannot start or continue as configured."""


class ModelLoadError(GRPOPluginsError):
    """The model or tokenizer named in the config cannot be loaded."""
