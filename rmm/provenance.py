"""Provenance: the code and environment a run ran with, fixed when its process starts.

:func:`capture` reads once per process (the first call wins, later calls return the same object) the git
revision of this checkout, whether its code differs from that revision, and the difference itself: ``git
diff HEAD`` of the tracked files, followed by a new-file diff of each untracked, not ignored file under
``CODE_PATHS`` (rmm/, studies/, checks/, conf/, run.py: code too, though git does not track it yet), with
the installed versions of the packages that shape results. ``python run.py`` captures before Hydra composes
its config, and :func:`rmm.runner.run` and :func:`rmm.evaluate` at their start when nothing captured
before, so an edit made while a process runs is never attributed to the runs it writes. Code a process
imports later than its capture (a module loaded lazily) is read from disk then; edits in that window of
seconds are the one blind spot.

:func:`runtime_info` adds what the run's machine gives it (CPU capability, torch's threads, the GPU), read
when a run starts, before its model loads. A run's ``metrics.json`` holds both (docs/results_format.md);
``code.diff`` beside it holds the difference, so that ``git apply code.diff`` on the recorded revision
restores the code that ran.

Only the standard library is imported here: run.py captures before torch or transformers load.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "datasets", "hydra-core", "wandb", "numpy", "pandas")
REPO_ROOT = Path(__file__).resolve().parents[1]
CODE_PATHS = ("rmm", "studies", "checks", "conf", "run.py")  # untracked files here are code too
DIFF_FILE = "code.diff"  # the uncommitted code, beside a run written from a dirty tree
# A diff that git apply takes back, whatever the user's git config (colour, external tools, prefixes).
_DIFF_OPTIONS = (
    "--no-color",
    "--no-ext-diff",
    "--no-textconv",
    "--no-renames",
    "--binary",
    "--src-prefix=a/",
    "--dst-prefix=b/",
)
_GIT_TIMEOUT_S = 30
_FIX = "commit or stash your changes, or run from a clean worktree (git worktree add ../rmm-clean HEAD)"


class DirtyTreeError(RuntimeError):
    """A registered run (``provenance.require_clean=true``) from code that is not committed."""


@dataclass(frozen=True)
class Provenance:
    """The checkout's code and the package versions, as one process found them."""

    revision: str | None  # HEAD's commit; None outside a git checkout or without git
    diff: bytes | None  # the uncommitted code (b"" when clean); None when unknown
    package_versions: dict[str, str | None] = field(default_factory=dict)

    @property
    def dirty(self) -> bool | None:
        """Whether the code differs from ``revision`` (None when unknown)."""
        return None if self.diff is None else bool(self.diff)

    @property
    def diff_sha256(self) -> str | None:
        """sha256 of ``diff`` (of ``code.diff``'s bytes), None when clean or unknown."""
        return hashlib.sha256(self.diff).hexdigest() if self.diff else None

    @property
    def git_revision(self) -> str:
        """``"<sha>"``, ``"<sha>-dirty"`` or ``"unknown"``: the metric's format since its first runs."""
        if self.revision is None:
            return "unknown"
        return f"{self.revision}-dirty" if self.dirty else self.revision

    def changed_files(self) -> list[str]:
        """The paths the diff changes (its ``diff --git a/... b/...`` headers)."""
        paths = []
        for line in (self.diff or b"").splitlines():
            if line.startswith(b"diff --git a/"):
                paths.append(os.fsdecode(line[len(b"diff --git a/") :]).split(" b/", 1)[0])
        return paths

    def metrics(self) -> dict[str, Any]:
        """``git_revision``, ``code_dirty``, ``code_diff_sha256`` and ``package_versions`` (metrics.json)."""
        return {
            "git_revision": self.git_revision,
            "code_dirty": self.dirty,
            "code_diff_sha256": self.diff_sha256,
            "package_versions": dict(self.package_versions),
        }

    def require_clean(self) -> None:
        """Raise :class:`DirtyTreeError` unless the code is known to be a commit's, unchanged."""
        if self.dirty is False:
            return
        if self.dirty is None:
            raise DirtyTreeError(
                f"this run is registered (provenance.require_clean=true) and must run from committed code, "
                f"but {REPO_ROOT} is not a git checkout (or git failed) so its code cannot be named; run it "
                "from a git checkout of the harness"
            )
        files = self.changed_files()
        shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        shown = shown or "uncommitted changes"
        raise DirtyTreeError(
            f"this run is registered (provenance.require_clean=true) and must run from committed code, but "
            f"{REPO_ROOT} differs from {self.revision} in {shown}: {_FIX}"
        )


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape results (None where not installed), and Python's."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return versions


def _git(root: Path, *args: str, ok: tuple[int, ...] = (0,)) -> bytes:
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    result = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, env=env, timeout=_GIT_TIMEOUT_S
    )
    if result.returncode not in ok:
        raise subprocess.CalledProcessError(result.returncode, args, result.stdout, result.stderr)
    return result.stdout


def code_state(root: str | Path | None = None) -> tuple[str | None, bytes | None]:
    """``(HEAD, diff)`` of the checkout at ``root`` (default: this harness's, ``REPO_ROOT``), read now;
    ``(None, None)`` when ``root`` is not the top of a git checkout or git fails."""
    root = Path(REPO_ROOT if root is None else root)
    try:
        top = os.fsdecode(_git(root, "rev-parse", "--show-toplevel").strip())
        if Path(top).resolve() != root.resolve():  # an installed copy inside some other checkout
            return None, None
        revision = _git(root, "rev-parse", "--verify", "HEAD").decode().strip()
        diff = _git(root, "diff", *_DIFF_OPTIONS, "HEAD")
        untracked = _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", *CODE_PATHS)
        for path in sorted(p for p in untracked.split(b"\0") if p):
            # exit status 1: the files differ, as a new file always does from /dev/null
            diff += _git(
                root, "diff", "--no-index", *_DIFF_OPTIONS, "--", os.devnull, os.fsdecode(path), ok=(0, 1)
            )
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return None, None
    return revision, diff


def read(root: str | Path | None = None) -> Provenance:
    """The provenance of the checkout at ``root`` as it is now (uncached; runs use :func:`capture`)."""
    revision, diff = code_state(root)
    return Provenance(revision, diff, package_versions())


_captured: Provenance | None = None


def capture() -> Provenance:
    """This process's provenance: read at the first call, the same object at every later one."""
    global _captured
    if _captured is None:
        _captured = read()
    return _captured


def runtime_info(device: Any = None) -> dict[str, Any]:
    """``cpu_capability`` (torch's CPU kernels: ``AVX2``, ``AVX512``, ...), ``torch_threads``, and
    ``device_name``: the GPU's name when ``device`` is a CUDA device, else None. Imports torch."""
    import torch

    get_capability = getattr(torch.backends.cpu, "get_cpu_capability", None)
    device = torch.device(device) if device is not None else None
    cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
    return {
        "cpu_capability": get_capability() if get_capability is not None else None,
        "torch_threads": torch.get_num_threads(),
        "device_name": torch.cuda.get_device_name(device) if cuda else None,
    }
