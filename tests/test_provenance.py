"""Provenance: the code a run ran, fixed when its process starts; code.diff beside a run from a dirty tree;
registered runs refused from a dirty tree before the model loads. Every test builds its own git repository
(or a made-up capture), so none depends on this checkout being clean or dirty."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import SENTENCES, tiny_model, tiny_tokenizer
from hydra import compose, initialize_config_dir

from rmm import provenance, runner
from rmm.provenance import DIFF_FILE, DirtyTreeError, Provenance
from rmm.storage import read_metrics, run_is_complete, write_run

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
DIFF = b"diff --git a/rmm/engine.py b/rmm/engine.py\n--- a/rmm/engine.py\n+++ b/rmm/engine.py\n@@ -1 +1 @@\n"
DIRTY = Provenance("0" * 40, DIFF, {"torch": "0.0"})
CLEAN = Provenance("1" * 40, b"", {"torch": "0.0"})
UNKNOWN = Provenance(None, None, {"torch": "0.0"})


def git(repo: Path, *args: str) -> str:
    command = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A committed checkout with code under rmm/ and a .gitignore, as ``provenance.REPO_ROOT``, with no
    capture yet in this process."""
    repo = tmp_path / "repo"
    (repo / "rmm").mkdir(parents=True)
    (repo / "rmm" / "engine.py").write_text("a = 1\n")
    (repo / ".gitignore").write_text("*.log\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "c")
    monkeypatch.setattr(provenance, "REPO_ROOT", repo)
    monkeypatch.setattr(provenance, "_captured", None)
    return repo


def test_clean_dirty_untracked_and_unknown(repo: Path, tmp_path: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    (repo / "notes.txt").write_text("untracked outside the code paths")
    (repo / "rmm" / "run.log").write_text("ignored")
    clean = provenance.read()
    assert clean.metrics() | {"package_versions": None} == {
        "git_revision": head,
        "code_dirty": False,
        "code_diff_sha256": None,
        "package_versions": None,
    }
    clean.require_clean()

    (repo / "rmm" / "engine.py").write_text("a = 2\n")
    (repo / "rmm" / "new.py").write_text("b = 1\n")  # untracked code counts
    dirty = provenance.read()
    assert dirty.git_revision == f"{head}-dirty" and dirty.dirty
    assert dirty.diff_sha256 == hashlib.sha256(dirty.diff).hexdigest()
    assert dirty.changed_files() == ["rmm/engine.py", "rmm/new.py"]
    assert b"notes.txt" not in dirty.diff and b"run.log" not in dirty.diff
    with pytest.raises(
        DirtyTreeError, match=r"rmm/engine.py, rmm/new.py: commit or stash .*\(git worktree add"
    ):
        dirty.require_clean()

    clone = tmp_path / "clone"  # the diff on the recorded revision restores the code that ran
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    (clone / DIFF_FILE).write_bytes(dirty.diff)
    git(clone, "apply", DIFF_FILE)
    for name in ("engine.py", "new.py"):
        assert (clone / "rmm" / name).read_text() == (repo / "rmm" / name).read_text()

    assert provenance.read(repo / "rmm").git_revision == "unknown"  # an installed copy inside a checkout
    unknown = provenance.read(tmp_path / "not_a_repo")
    assert unknown.metrics()["git_revision"] == "unknown" and unknown.dirty is None
    with pytest.raises(DirtyTreeError, match="not a git checkout"):
        unknown.require_clean()


def test_first_capture_wins(repo: Path) -> None:
    """An edit after the capture is not attributed to the process: it records the code it started with."""
    (repo / "rmm" / "engine.py").write_text("a = 2\n")
    first = provenance.capture()
    (repo / "rmm" / "engine.py").write_text("a = 3\n")
    assert provenance.capture() is first and b"+a = 2" in first.diff
    assert provenance.read().diff_sha256 != first.diff_sha256


def test_write_run_writes_code_diff_only_when_dirty(tmp_path: Path) -> None:
    frame = pd.DataFrame(
        {
            "doc_id": ["d"] * 2,
            "position": [0, 1],
            "token_id": [3, 4],
            "nll": [None, 1.0],
            "correct": [None, True],
        }
    )
    run_dir = tmp_path / "run"
    write_run(run_dir, {}, {"ppl": 2.0, **DIRTY.metrics()}, frame, code_diff=DIRTY.diff)
    assert (run_dir / DIFF_FILE).read_bytes() == DIFF and run_is_complete(run_dir)
    assert (
        hashlib.sha256((run_dir / DIFF_FILE).read_bytes()).hexdigest()
        == read_metrics(run_dir)["code_diff_sha256"]
    )
    write_run(run_dir, {}, {"ppl": 2.0, **CLEAN.metrics()}, frame, code_diff=CLEAN.diff)
    assert not (run_dir / DIFF_FILE).exists()  # no stale diff beside a run rewritten from a clean tree
    with pytest.raises(ValueError, match="code_diff_sha256"):
        write_run(tmp_path / "other", {}, {"ppl": 2.0, **DIRTY.metrics()}, frame, code_diff=b"another diff")
    assert not (tmp_path / "other").exists()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_provenance")
    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "texts").mkdir()
    for i, sentence in enumerate(SENTENCES[:2]):
        (root / "texts" / f"doc{i}.txt").write_text(" ".join([sentence] * 4))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RMM_CACHE", str(root / "cache"))
        yield {"model": root / "model", "texts": root / "texts"}


def config(tiny: dict[str, Path], *overrides: str):
    base = [
        "model=local",
        f"model.path={tiny['model']}",
        "model.name=tiny_llama",
        "dataset=textdir",
        f"dataset.path={tiny['texts']}",
        "dataset.max_tokens=24",
        "policy=h2o",
        "budget=8",
        "chunk=4",
        "device=cpu",
        "dtype=float32",
        "wandb.mode=disabled",
        "progress=false",
    ]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=[*base, *overrides])


def test_run_records_the_code_captured_at_start(repo: Path, tiny: dict[str, Path], tmp_path: Path) -> None:
    """A run from a dirty tree writes code.diff and its hash, of the code as the process found it."""
    (repo / "rmm" / "engine.py").write_text("a = 2\n")
    started = provenance.capture()  # as run.py does before Hydra composes
    (repo / "rmm" / "engine.py").write_text("a = 3\n")  # edited while the run's process is up
    metrics = runner.run(config(tiny), tmp_path / "run")
    assert metrics["git_revision"] == f"{git(repo, 'rev-parse', 'HEAD')}-dirty" and metrics["code_dirty"]
    assert metrics["code_diff_sha256"] == started.diff_sha256
    assert (tmp_path / "run" / DIFF_FILE).read_bytes() == started.diff
    assert metrics["cpu_capability"] and metrics["torch_threads"] >= 1 and metrics["device_name"] is None
    assert read_metrics(tmp_path / "run") == metrics


def test_registered_run_from_a_dirty_tree_is_refused_before_the_model_loads(
    tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(runner, "load_model", load_model)
    registered = config(tiny, "provenance.require_clean=true")
    for found, match in (
        (DIRTY, "rmm/engine.py: commit or stash your changes"),
        (UNKNOWN, "not a git checkout"),
    ):
        monkeypatch.setattr(provenance, "_captured", found)
        with pytest.raises(DirtyTreeError, match=match):
            runner.run(registered, tmp_path / "run")
        assert not (tmp_path / "run").exists()
    monkeypatch.setattr(provenance, "_captured", CLEAN)
    with pytest.raises(Loaded):  # a clean tree goes on to load the model
        runner.run(registered, tmp_path / "run")
    monkeypatch.setattr(provenance, "_captured", DIRTY)
    with pytest.raises(Loaded):  # an unregistered run goes on from a dirty tree
        runner.run(config(tiny), tmp_path / "run")


def test_registered_presets_and_resume() -> None:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        assert compose("config").provenance.require_clean is False
        for preset in ("confirm_cpu_common", "confirm_cpu_natural", "confirm_cpu_natural_lags"):
            assert compose("config", overrides=[f"experiment={preset}"]).provenance.require_clean is True
    stored = {"budget": 8, "policy": {"name": "h2o"}}  # a run written before the key existed
    assert runner.changed_keys(stored, {**stored, "provenance": {"require_clean": True}}) == []


# python run.py -m with a dirty capture, from a fresh interpreter (about 10 s; the conftest's background
# marker runs it beside the suite): it prints its sweep folder first.
SWEEP = (
    "import runpy, sys, tempfile\n"
    "from rmm import provenance\n"
    f"provenance._captured = provenance.Provenance('0' * 40, {DIFF!r}, {{}})\n"
    "sweep_dir = tempfile.mkdtemp(prefix='rmm_refused_sweep_')\n"
    "print(sweep_dir, flush=True)\n"
    "sys.argv = ['run.py', '-m', f'hydra.sweep.dir={sweep_dir}', *sys.argv[1:]]\n"
    "runpy.run_path('run.py', run_name='__main__')\n"
)
SWEEP_OVERRIDES = ["policy=h2o,tova", "provenance.require_clean=true", "dataset.n_docs=1", "budget=32"]
SWEEP_OVERRIDES += ["chunk=16", "device=cpu", "wandb.mode=disabled", "progress=false"]


@pytest.mark.background([sys.executable, "-c", SWEEP, *SWEEP_OVERRIDES], cwd=ROOT)
def test_run_py_stops_a_registered_sweep_from_a_dirty_tree(background: subprocess.CompletedProcess) -> None:
    """The first job is refused before its model loads, the sweep stops there, and no job leaves an
    error.txt (a failing job of an unregistered sweep does, and the sweep goes on)."""
    sweep_dir, stderr = Path(background.stdout.splitlines()[0]), background.stderr
    try:
        assert background.returncode != 0, stderr[-3000:]
        assert "refused: this run is registered" in stderr and "commit or stash" in stderr
        assert not list(sweep_dir.rglob("error.txt")) and not list(sweep_dir.rglob("metrics.json"))
        assert not [p for p in sweep_dir.rglob("*") if "tova" in p.name]  # the second job never started
    finally:
        shutil.rmtree(sweep_dir, ignore_errors=True)


def test_evaluate_records_the_code_and_save_writes_its_diff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rmm.evaluate, the library's path, records the same provenance as a run and saves code.diff."""
    import rmm
    from checks.matrix import sampled_stream, tiny_model

    monkeypatch.setattr(provenance, "_captured", DIRTY)
    model = tiny_model("llama")
    result = rmm.evaluate(model, token_ids=[sampled_stream(model, 12)], policy="window", budget=4, chunk=2)
    assert result.metrics["code_diff_sha256"] == DIRTY.diff_sha256 and result.metrics["cpu_capability"]
    run_dir = result.save(tmp_path / "run")
    assert (run_dir / DIFF_FILE).read_bytes() == DIFF and read_metrics(run_dir) == result.metrics
