"""How this project calls ``torch.compile``, and the compile cache kept between runs.

Every region the project compiles (a decoder layer of the training passes, the chunked
log-softmax, the static generator's decode layer and head) goes through :func:`compile_region`:
``dynamic=True`` so that rows and lengths never recompile, but with Python ints and floats
(head counts, RMSNorm's epsilon, the sampling settings) compiled in as constants. Symbolic ones
bought nothing -- they are fixed for a run -- and cost twice: a symbolic head count filled the
decode layer's trace with ~190 shape guards, and a symbolic float made dynamo restart the layer's
trace, and the graph it restarted with differed between a first run and the next, so a second
run on the same machine still missed torch's cache for the largest graphs.

:class:`CompileCache` keeps torch's compile artifacts (``torch.compiler.save_cache_artifacts``:
inductor's generated code, AOTAutograd's graphs, autotuning results) in one file per torch
version, device, model shape and compile settings, under ``~/.cache/grpo-plugins/compile`` (or
the directory named by ``GRPO_PLUGINS_COMPILE_CACHE``; ``0``/``off`` turns it off). A run loads
its file before compiling, which fills torch's own caches, and rewrites it (atomically) after a
step in which torch's caches missed (a run whose graphs all came from them leaves it alone). A
file that cannot be read or loaded is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import torch

__all__ = ["CACHE_ENV", "CompileCache", "compile_region", "compile_settings", "default_cache_dir"]

logger = logging.getLogger(__name__)

#: The environment variable naming the compile cache directory (``0``, ``off``, ``false``: none).
CACHE_ENV = "GRPO_PLUGINS_COMPILE_CACHE"

#: Dynamo settings for every compiled region (see the module docstring).
_DYNAMO_SETTINGS: dict[str, Any] = {"specialize_int": True, "specialize_float": True}
if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
    # transformers 5.25 wraps attention forwards (the `kernels` package's use_kernelized_func) in
    # a global's set and reset. Under activation checkpointing dynamo refuses that side effect
    # and breaks the decoder layer's graph unless the backward's recompute may skip it; the set
    # and reset cancel out, so skipping them changes nothing.
    _DYNAMO_SETTINGS["skip_fwd_side_effects_in_bwd_under_checkpoint"] = True


def compile_region(fn: Callable[..., Any], *, backend: Any = "inductor", fullgraph: bool = False) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=True)`` with tensor sizes symbolic and Python ints and floats
    constants (:func:`compile_settings` around each call). The result is a plain function (it
    binds as a method like ``fn``)."""
    compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=fullgraph)

    config = torch._dynamo.config

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if all(getattr(config, key) == value for key, value in _DYNAMO_SETTINGS.items()):  # inside a block already
            return compiled(*args, **kwargs)
        with compile_settings():
            return compiled(*args, **kwargs)

    return run


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """Dynamo's settings for :func:`compile_region` inside the block (dynamo reads them when it
    traces, i.e. inside a call). Nothing to do where they hold already, so a block around many
    calls (a training pass, a decode step) makes each call's own switch nearly free."""
    config = torch._dynamo.config
    prior = {key: getattr(config, key) for key in _DYNAMO_SETTINGS}
    if prior == _DYNAMO_SETTINGS:
        yield
        return
    for key, value in _DYNAMO_SETTINGS.items():
        setattr(config, key, value)
    try:
        yield
    finally:
        for key, value in prior.items():
            setattr(config, key, value)


def default_cache_dir() -> Path | None:
    """The compile cache directory: ``GRPO_PLUGINS_COMPILE_CACHE``, else
    ``$XDG_CACHE_HOME/grpo-plugins/compile`` (``~/.cache/...``); None when turned off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        if value.strip().lower() in ("", "0", "off", "false", "no"):
            return None
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "grpo-plugins" / "compile"


def _model_description(model: Any) -> dict[str, Any]:
    """What of a (peft-wrapped) model decides its compiled graphs: its config (minus paths and
    names) and the adapters' settings."""
    config = getattr(model, "config", None)
    shape = config.to_dict() if hasattr(config, "to_dict") else {}
    for key in ("_name_or_path", "name_or_path", "_commit_hash"):
        shape.pop(key, None)
    adapters = {}
    for name, peft_config in (getattr(model, "peft_config", None) or {}).items():
        adapters[name] = peft_config.to_dict() if hasattr(peft_config, "to_dict") else repr(peft_config)
        if isinstance(adapters[name], dict):
            adapters[name].pop("base_model_name_or_path", None)
    return {"config": shape, "adapters": adapters}


def _device_description(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"type": device.type}
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=[props.major, props.minor], cuda=torch.version.cuda)
    else:
        info["machine"] = platform.machine()
    return info


class CompileCache:
    """torch's compile artifacts for one (torch, device, model shape, settings) in one file.

    Args:
        path: the file; None: a cache that does nothing.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._saved_misses = 0  # torch's cache misses at the last save

    @classmethod
    def for_run(cls, model: Any, device: torch.device, settings: dict[str, Any], directory: Path | None = None) -> CompileCache:
        """The cache file of ``model`` on ``device`` compiled with ``settings`` (anything else
        that shapes the graphs: dtype, backends), in ``directory`` (default
        :func:`default_cache_dir`)."""
        directory = directory if directory is not None else default_cache_dir()
        if directory is None:
            return cls(None)
        import transformers

        key = {
            "torch": torch.__version__,
            "torch_git": getattr(torch.version, "git_version", None),
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "device": _device_description(device),
            "model": _model_description(model),
            "settings": settings,
        }
        text = json.dumps(key, sort_keys=True, default=_plain)
        digest = hashlib.sha256(text.encode()).hexdigest()[:24]
        model_type = str(key["model"]["config"].get("model_type", "model"))
        version = torch.__version__.replace("+", "_")
        return cls(directory / f"{model_type}-torch{version}-{digest}.bin")

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def load(self) -> bool:
        """Fill torch's caches from the file (before compiling); True if it did. A missing file
        is a cold start; an unreadable one a warning."""
        if self.path is None or not self.path.is_file():
            return False
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as exc:  # a cache must never stop a run: compile from scratch instead
            logger.warning("compile cache: could not load %s (%s: %s); compiling from scratch", self.path, type(exc).__name__, exc)
            return False
        if info is None:
            logger.warning("compile cache: %s holds no artifacts this torch can use; compiling from scratch", self.path)
            return False
        logger.info("compile cache: loaded %s", self.path)
        return True

    def save_if_new(self) -> bool:
        """Write the artifacts of this process's compilations to the file (atomically: a
        temporary file, then a rename) when torch's caches missed since the last save, or when
        there is no file yet; True if it wrote. A run whose graphs all came from the caches
        leaves the file as it is."""
        if self.path is None:
            return False
        misses = _cache_misses()
        if misses <= self._saved_misses and (self.path.is_file() or _graph_count() == 0):
            return False
        self._saved_misses = misses
        try:
            artifacts = torch.compiler.save_cache_artifacts()
            if artifacts is None:
                return False
            data = artifacts[0]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except Exception as exc:
            logger.warning("compile cache: could not write %s (%s: %s); the next run compiles again", self.path, type(exc).__name__, exc)
            return False
        logger.info("compile cache: saved %s (%.1f MB)", self.path, len(data) / 1e6)
        return True


def _plain(value: Any) -> Any:
    """JSON for what ``json`` cannot write: sets sorted (their order differs between processes),
    anything else its repr."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return repr(value)


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _cache_misses() -> int:
    """Graphs inductor and AOTAutograd compiled rather than found in their caches so far."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return int(inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"] + aot["autograd_cache_miss"])
