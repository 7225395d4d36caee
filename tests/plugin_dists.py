"""Throwaway plugin distributions for tests: a module plus a ``*.dist-info`` on a path entry."""

from __future__ import annotations

import textwrap
from pathlib import Path


def make_distribution(
    root: Path,
    dist: str,
    version: str,
    modules: dict[str, str],
    entry_points: dict[str, str] | None = None,
) -> Path:
    """Write ``modules`` (name -> source) and an installed-distribution record to ``root``.

    ``entry_points`` (entry-point name -> module) go into group ``grpo_plugins``; default: one
    per module, named like it. Put ``root`` on ``sys.path`` / ``PYTHONPATH`` to "install" it.
    """
    root.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n", encoding="utf-8")
    eps = entry_points if entry_points is not None else {m: m for m in modules}
    lines = "".join(f"{k} = {v}\n" for k, v in eps.items())
    (info / "entry_points.txt").write_text(f"[grpo_plugins]\n{lines}", encoding="utf-8")
    (info / "RECORD").write_text("", encoding="utf-8")
    return root


def reward_plugin(*names: str, params: bool = False) -> str:
    """Source of a plugin module registering rewards called ``names`` (with a Params model)."""
    body = ["from pydantic import BaseModel", "from grpo_plugins import hookimpl", ""]
    body += [
        "class LenParams(BaseModel):",
        "    max_len: int = 100",
        "",
        "class LenReward:",
        '    """Scores short completions."""',
        "    Params = LenParams",
        "    def __init__(self, params):",
        "        self.params = params",
        "    def __call__(self, prompts, completions, **kwargs):",
        "        return [float(len(c) <= self.params.max_len) for c in completions]",
        "",
        "def plain(prompts, completions, **kwargs):",
        '    """Always 1."""',
        "    return [1.0] * len(completions)",
        "",
        "@hookimpl",
        "def register_rewards(register):",
    ]
    for name in names:
        body.append(f"    register({'LenReward' if params else 'plain'}, name={name!r})")
    return "\n".join(body) + "\n"
