"""The README stays a front page that lists every module, and its numbers' sources exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


def test_layout_lists_every_module() -> None:
    layout = section("Layout")
    missing = [f"rmm/{p.name}" for p in sorted((ROOT / "rmm").glob("*.py")) if p.name != "__init__.py"]
    missing = [name for name in missing if name not in layout]
    scripts = [p for p in sorted((ROOT / "experiments").iterdir()) if p.suffix in (".py", ".sh")]
    missing += [f"experiments/{p.name}" for p in scripts if p.name != "__init__.py" and p.name not in layout]
    if any((ROOT / "rmm" / "policies").glob("*.py")) and "rmm/policies/" not in layout:
        missing.append("rmm/policies/")
    assert not missing, f"add these modules to the README's Layout section: {missing}"


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
    """docs/studies.md claims every sweep preset, study script and results entry exactly once."""
    import fnmatch

    text = (ROOT / "docs" / "studies.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| study")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    presets = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    presets += ["lag_arm/"]
    for preset in presets:
        owners = []
        for cell in (row[2] for row in cells):
            names = re.findall(r"`([^`]+)`", cell.split(" but ")[0])
            excluded = re.findall(r"`([^`]+)`", cell.split(" but ")[1]) if " but " in cell else []
            if any(fnmatch.fnmatch(preset, name) for name in names) and preset not in excluded:
                owners.append(cell)
        assert len(owners) == 1, (
            f"conf/experiment/{preset} belongs to {len(owners)} studies in docs/studies.md"
        )
    scripts = [p.name for p in (ROOT / "experiments").glob("*.sh") if p.name != "sweeps.sh"]
    for script in scripts:
        assert sum(f"`{script}`" in row[3] for row in cells) == 1, f"experiments/{script} in docs/studies.md"
    for entry in sorted((ROOT / "results" / "cpu").iterdir()):
        if entry.name.startswith("."):
            continue
        named = (f"results/cpu/{entry.name}", f"`{entry.name}`", f"`{entry.name}/`")
        assert any(form in text for form in named), f"results/cpu/{entry.name} is in no study"
