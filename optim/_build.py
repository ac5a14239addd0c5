"""Building optim's C++ sources with the system's compiler, cached on disk (the one place that does).

Used by the CPU kernel (:mod:`optim._cpu_kernel`: plain shared libraries loaded with ctypes) and the
step plans' host helper (:mod:`optim._host`: a Python extension built against the installed torch).
A library is cached under ``$SRADAMW_CPU_CACHE`` (default ``~/.cache/clip-sr-recipe/sradamw_cpu``),
named by a hash of its source, the headers beside it, the compile arguments and this host (compiler
version, CPU features), so a library built for another host or another torch is never loaded. It is
written under a temporary name and renamed into place: ranks that build at the same time never load a
half-written file.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["compiler", "host_signature", "cache_dir", "library_path", "compile_library"]

_HOST: str | None = None  # compiler version + CPU features (part of every cache key)


def compiler() -> str:
    """``$CXX``, else the first of ``c++``, ``g++``, ``clang++`` on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no C++ compiler found (set CXX, or install g++)")


def host_signature() -> str:
    """The compiler's version and the CPU's feature flags (read once per process)."""
    global _HOST
    if _HOST is None:
        version = subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=True).stdout
        features = platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                features += next((line for line in f if line.startswith(("flags", "Features"))), "")
        except OSError:
            features += platform.processor()
        _HOST = version + features
    return _HOST


def cache_dir() -> Path:
    root = os.environ.get("SRADAMW_CPU_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "clip-sr-recipe" / "sradamw_cpu"


def library_path(source: Path, args: Sequence[str], key_extra: str = "") -> Path:
    """Where the library of ``source`` compiled with ``args`` is cached (built or not)."""
    texts = [source.read_text(), *(h.read_text() for h in sorted(source.parent.glob("*.h")))]  # + the headers
    key = hashlib.sha256("\0".join([*texts, *args, host_signature(), *([key_extra] if key_extra else [])])
                         .encode()).hexdigest()[:24]
    return cache_dir() / f"{source.stem}_{key}.so"


def compile_library(source: Path, args: Sequence[str], *, what: str, link: Sequence[str] = (),
                    key_extra: str = "") -> Path:
    """Compiles ``source`` with ``args`` (then ``link``, which does not enter the cache key beyond
    ``key_extra``) into its :func:`library_path`, atomically; a failure raises ``RuntimeError`` with the
    command and the compiler's last words."""
    path = library_path(source, args, key_extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        cmd = [compiler(), *args, str(source), "-o", tmp, *link]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            first = next((line.strip() for line in done.stderr.splitlines() if "error" in line),
                         done.stderr.strip()[-300:])
            raise RuntimeError(f"building {what} failed: {first} ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent builder renames an identical file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
