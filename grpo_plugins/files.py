"""Files and folders written through a temporary name (then renamed into place) get the
permissions an ordinary ``open``/``mkdir`` would give them.

``tempfile.mkdtemp`` and ``mkstemp`` create private entries (0700 / 0600) whatever the umask, so an
exported model or GGUF file renamed from them would be unreadable to the user's group and others.
safetensors' ``save_file`` (under every ``save_pretrained``) writes its files as 0600 too.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["as_ordinary", "as_ordinary_tree"]


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it; set straight back
    os.umask(mask)
    return mask


def as_ordinary(path: str | os.PathLike[str]) -> None:
    """Give ``path`` (a file or a folder) the mode a plain ``open`` or ``mkdir`` would have made:
    0666 or 0777 less the umask."""
    path = Path(path)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())


def as_ordinary_tree(root: str | os.PathLike[str]) -> None:
    """:func:`as_ordinary` for ``root`` and everything under it (symbolic links are left alone)."""
    root = Path(root)
    as_ordinary(root)
    for folder, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(folder, name)
            if not path.is_symlink():
                as_ordinary(path)
