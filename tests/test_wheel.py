"""The harness as a library: the built wheel, installed alone into a fresh virtual environment, gives
``import rmm`` with its configs and runs the README's example (slow: builds a wheel)."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import tiny_model, tiny_tokenizer
from test_api import readme_example

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_the_readme_example(tmp_path: Path) -> None:
    wheels, source = tmp_path / "wheels", tmp_path / "source"  # built from a copy: the checkout stays clean
    skip = shutil.ignore_patterns(
        ".git", ".venv", "results", "runs", "multirun", "outputs", "build", "*.egg-info"
    )
    shutil.copytree(ROOT, source, symlinks=True, ignore=skip)
    pip_wheel = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(wheels),
    ]
    subprocess.run([*pip_wheel, str(source)], check=True, capture_output=True)
    (wheel,) = wheels.glob("rmm_harness-*.whl")
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    fresh_site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # only the wheel is installed; torch, transformers and the other dependencies are read from this
    # environment's site-packages as a plain path (its .pth files, the editable install among them, are
    # not processed, so the checkout's rmm is not importable there)
    (fresh_site / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    model_dir = tmp_path / "model"
    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    script = readme_example().replace('MODEL = "HuggingFaceTB/SmolLM2-135M"', f'MODEL = "{model_dir}"')
    check = (
        "\nimport rmm.config\n"
        "assert str(fresh) in rmm.__file__, rmm.__file__\n"
        "assert (rmm.files.config_dir() / 'policy' / 'rmm.yaml').is_file()\n"
        "print('ppl', ours.ppl)\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run(
        [python, "-c", f"fresh = {str(env_dir)!r}\n" + script + check],
        cwd=work,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ppl" in out.stdout and (work / "runs" / "my_rmm" / "metrics.json").is_file()
