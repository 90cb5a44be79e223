"""The README stays a front page that lists every module, and its numbers' sources exist."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


def test_layout_lists_every_module() -> None:
    layout = section("Layout")
    modules = [p for p in sorted((ROOT / "rmm").glob("*.py")) if p.name != "__init__.py"]
    modules += [p for p in sorted((ROOT / "rmm" / "analysis").glob("*.py")) if p.name != "__init__.py"]
    modules += [p for p in sorted((ROOT / "checks").glob("*.py")) if p.name != "__init__.py"]
    missing = [p.relative_to(ROOT).as_posix() for p in modules]
    missing = [name for name in missing if name not in layout and Path(name).name not in layout]
    missing += [f"studies/{d.name}/" for d in study_dirs() if f" {d.name}/" not in layout]
    if any((ROOT / "rmm" / "policies").glob("*.py")) and "rmm/policies/" not in layout:
        missing.append("rmm/policies/")
    assert not missing, f"add these modules to the README's Layout section: {missing}"


def study_dirs() -> list[Path]:
    return sorted(d for d in (ROOT / "studies").iterdir() if d.is_dir() and d.name != "__pycache__")


def test_readme_is_a_front_page() -> None:
    lines = README.splitlines()
    assert len(lines) <= 200, f"README has {len(lines)} lines; move detail into docs/"
    block = lines.index("```bash")  # what the harness is first, then the two entry points
    assert 4 <= block <= 15 and lines[2] and not lines[2].startswith(("```", "#"))
    assert lines[block + 1].startswith("make run") and lines[block + 2].startswith("make test")


def test_linked_files_exist() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to a missing file: {target}"


def test_adding_a_policy_shows_the_code_as_it_is() -> None:
    """docs/adding_a_policy.md's policy file and config are lru's, verbatim; and a decorated policy class
    in the package is all the registry needs."""
    from rmm.policies import POLICIES
    from rmm.policies.lru import LRU

    doc = (ROOT / "docs" / "adding_a_policy.md").read_text()
    policy = re.search(r"## 2\. The policy file.*?```python\n(.*?)```", doc, re.S).group(1)
    config = re.search(r"## 4\. The config.*?```yaml\n(.*?)```", doc, re.S).group(1)
    assert policy == (ROOT / "rmm" / "policies" / "lru.py").read_text()
    assert config == (ROOT / "conf" / "policy" / "lru.yaml").read_text()
    assert POLICIES["lru"] is LRU


def test_every_study_file_belongs_to_one_study() -> None:
    """Each study folder's README names its every file, its presets, a reading that exists and its results;
    docs/studies.md indexes every folder once; every results/cpu entry belongs to exactly one study (or to
    the checks named in docs/studies.md); every folder with presets is on Hydra's search path."""
    index = (ROOT / "docs" / "studies.md").read_text()
    searchpath = (ROOT / "conf" / "config.yaml").read_text()
    claims: dict[str, list[str]] = {}
    for folder in study_dirs():
        readme = (folder / "README.md").read_text()
        assert index.count(f"[studies/{folder.name}/]") == 1, f"studies/{folder.name} in docs/studies.md"
        for entry in folder.iterdir():
            if entry.name in ("README.md", "__init__.py", "__pycache__", "experiment"):
                continue
            assert f"`{entry.name}`" in readme or f"studies/{folder.name}/{entry.name}" in readme, (
                f"studies/{folder.name}/README.md does not name {entry.name}"
            )
        presets = folder / "experiment"
        if presets.is_dir():
            assert f"pkg://studies.{folder.name}\n" in searchpath, f"studies.{folder.name}: not on searchpath"
            for preset in presets.iterdir():
                stem = preset.stem if preset.suffix == ".yaml" else f"{preset.name}/"
                patterns = re.findall(r"`experiment/([^`]+?)(?:\.yaml)?`", readme)
                assert any(fnmatch.fnmatch(stem, pattern) for pattern in patterns), (
                    f"studies/{folder.name}/README.md does not name its preset {preset.name}"
                )
        reading = re.search(r"\*\*Reading:\*\* (.*)", readme).group(1)
        for target in re.findall(r"\]\(([^)#]+)", reading):
            assert (folder / target).exists(), f"studies/{folder.name}/README.md links to a missing {target}"
        results = re.search(r"\*\*Results:\*\* (.*)", readme).group(1)
        for path in re.findall(r"`(results/[^`]+)`", results):
            assert (ROOT / path).exists(), f"studies/{folder.name}/README.md names a missing {path}"
            claims.setdefault(path.split("/")[2], []).append(folder.name)
    checks = index[index.index("The harness's own checks") :]
    for path in re.findall(r"`(results/cpu/[^`]+)`", checks):
        claims.setdefault(path.split("/")[2], []).append("checks")
    for entry in sorted((ROOT / "results" / "cpu").iterdir()):
        if not entry.name.startswith("."):
            owners = claims.get(entry.name, [])
            assert len(owners) == 1, f"results/cpu/{entry.name} belongs to {owners or 'no study'}"


def test_studies_import_only_the_library() -> None:
    """A study's code imports the library (and its own folder), never another study or a check: what two
    studies share lives in rmm/analysis/."""
    imports = re.compile(r"^\s*(?:from|import)\s+(studies|checks)(?:\.(\w+))?", re.M)
    for folder in study_dirs():
        for source in folder.rglob("*.py"):
            for package, name in imports.findall(source.read_text()):
                assert package == "studies" and name == folder.name, (
                    f"{source.relative_to(ROOT)} imports {package}.{name}: share via rmm/analysis/"
                )


def test_architecture_lists_every_policy_under_its_base() -> None:
    """docs/architecture.md names every registered policy once, under the base it derives from."""
    from rmm.policies import POLICIES
    from rmm.policies.base import PositionRule, ScorePolicy

    text = (ROOT / "docs" / "architecture.md").read_text()
    lists = {
        base: set(re.findall(r"`(\w+)`", re.search(rf"\(`{base.__name__}`: (.*?)\)", text, re.S).group(1)))
        for base in (PositionRule, ScorePolicy)
    }
    for name, cls in POLICIES.items():
        (base,) = [base for base in lists if issubclass(cls, base)]
        assert name in lists[base], f"docs/architecture.md does not list {name} under {base.__name__}"
    assert set().union(*lists.values()) == set(POLICIES)


def test_a_toy_study_by_the_doc_is_found_by_check_reports(tmp_path: Path) -> None:
    """docs/studies.md's step 3 (a script studies/<name>/<name>.sh reading REPORT_ONLY) is what
    `make check-reports` looks for: its own discovery command, run over a toy study, finds it."""
    doc = (ROOT / "docs" / "studies.md").read_text()
    assert "studies/<name>/<name>.sh" in doc and "REPORT_ONLY" in doc and "make check-reports" in doc
    found = re.search(r"for script in \$\$\((grep -l REPORT_ONLY [^)]*)\)", (ROOT / "Makefile").read_text())
    assert found, "make check-reports no longer finds the studies by REPORT_ONLY"
    toy = tmp_path / "studies" / "toy"
    toy.mkdir(parents=True)
    (toy / "toy.sh").write_text(
        'source studies/sweeps.sh\nif [ -z "${REPORT_ONLY:-}" ]; then run_sweeps; fi\n'
        "$PY -m studies.toy.report\n"
    )
    listed = subprocess.run(["bash", "-c", found.group(1)], cwd=tmp_path, capture_output=True, text=True)
    assert listed.stdout.split() == ["studies/toy/toy.sh"]
