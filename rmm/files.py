"""Local files and environment: atomic writes, the harness cache root, Hugging Face offline switches."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")


def _fsync_dir(directory: Path) -> None:
    """Flush a directory entry (a rename) to disk where the platform allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it onto ``path``.

    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # honours the umask, unlike mkstemp
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def cache_root() -> Path:
    """The harness cache: ``$RMM_CACHE`` if set, else ``~/.cache/rmm`` (``models/``, ``tokens/`` below it)."""
    return Path(os.environ.get("RMM_CACHE") or Path.home() / ".cache" / "rmm").expanduser()


def offline_switches(names: tuple[str, ...]) -> list[str]:
    """Those of the environment variables ``names`` set to a true value (read now, not at import time)."""
    return [name for name in names if os.environ.get(name, "").strip().lower() in _TRUE]


def config_dir() -> Path:
    """The Hydra configs (``conf/``), in a checkout or an installed wheel: ``initialize_config_dir(str(
    rmm.files.config_dir()))`` then ``compose("config", overrides=[...])``."""
    return Path(__file__).resolve().parent / "conf"
