"""Writing an output directory all at once: a reader sees no directory or the complete one.

:func:`write_directory` has the writer fill a hidden temporary sibling of the destination, then
renames it into place (one ``rename`` on the same filesystem). A writer that raises, or a process
that dies, leaves the destination untouched (an existing one included); the temporary directory is
removed on errors. Replacing an existing destination (``overwrite=True``) moves the old one aside
first and deletes it only after the new one is in place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["write_directory"]


def write_directory(out: str | os.PathLike, writer: Callable[[Path, Path], None], overwrite: bool = False) -> Path:
    """Runs ``writer(tmp, final)`` on an empty temporary directory ``tmp`` and renames it to ``out``
    (``final``: the absolute path of ``out``, for a writer that must name it).

    Raises:
        FileExistsError: ``out`` exists (a non-empty directory or a file) and ``overwrite`` is false.
        Whatever ``writer`` raises (``out`` is then as it was).
    """
    out = Path(out).absolute()
    exists = out.exists() and not (out.is_dir() and not any(out.iterdir()))
    if exists and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another --out or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        writer(tmp, out)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; an export is for others to read
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "previous")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
