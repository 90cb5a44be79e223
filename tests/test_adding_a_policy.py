"""docs/adding_a_policy.md followed as a new user would: a toy policy (keep the largest value norms) added
to a copy of the package by its steps alone (a file, a config, a reference rule, matrix cases), then run
against the reference in a fresh interpreter. Nothing else in the copy is edited."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# step 2: the policy file
POLICY = '''"""vnorm: keep the entries whose values have the largest L2 norm (the docs' toy policy).

score_j = ||v_j||_2 at SCORE_DIGITS significant digits; ties go to the more recent position.
"""

from dataclasses import dataclass

import torch

from rmm.policies.base import Observation, ScorePolicy, register, significant


@register
@dataclass
class VNorm(ScorePolicy):
    name = "vnorm"
    needs = frozenset({"values"})

    def score(self, state: dict[str, torch.Tensor], obs: Observation, now: int) -> torch.Tensor:
        return significant(torch.linalg.vector_norm(obs.values.double(), dim=-1))
'''
# step 4: the config
CONFIG = "name: vnorm\ntag: ''\n"
# step 5: the reference rule and its table entry
RULE = '''

def _vnorm(spec, record, layer, h, candidates, now, capacity) -> dict[int, float]:
    """The value's L2 norm at SCORE_DIGITS significant digits."""
    return {j: _significant(math.hypot(*record["values"][layer][h][j].double().tolist())) for j in candidates}

'''
# step 6: run the policy's matrix cases against the reference (what tests/test_policies.py does)
CHECK = """
import os

import rmm
from rmm.engine import StreamingEngine
from rmm.engine import retained_sets_recorder
from checks.matrix import CASES, distinct_stream, tiny_model
from rmm.policies import POLICIES, make_policy
from rmm.reference import ReferenceSpec, reference_stream

assert rmm.__file__.startswith(os.getcwd()), rmm.__file__  # the copy, not the checkout
assert ("vnorm", {}) in CASES and "vnorm" in POLICIES
model, tokens = tiny_model("llama"), distinct_stream(24)
for chunk in (1, 4, 5):
    for positions in ("original", "cache"):
        hook, sets = retained_sets_recorder()
        policy = make_policy({"name": "vnorm"}, budget=8, chunk=chunk)
        engine = StreamingEngine(model, policy, positions=positions)
        result = engine.stream(tokens, on_boundary=hook)
        spec = ReferenceSpec(policy="vnorm", budget=8, chunk=chunk, positions=positions)
        nll, _ = reference_stream(model, tokens, spec)
        assert float((result.nll - nll).abs().max()) <= 5e-6, (chunk, positions)
        assert all(sets[now] == spec.retained_log[now] for now in sets), (chunk, positions)
print("vnorm matches the reference")
"""


def test_a_toy_policy_added_by_the_docs_steps_matches_the_reference(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "adding_a_policy.md").read_text()
    for step in ("rmm/policies/", "conf/policy/", "rmm/reference.py", "`CASES` in `checks/matrix.py`"):
        assert step in doc, f"the doc no longer names {step}"
    for folder in ("rmm", "checks"):
        shutil.copytree(
            ROOT / folder, tmp_path / folder, symlinks=False, ignore=shutil.ignore_patterns("__pycache__")
        )
    package = tmp_path / "rmm"
    (package / "policies" / "vnorm.py").write_text(POLICY)
    (package / "conf" / "policy" / "vnorm.yaml").write_text(CONFIG)
    reference = (package / "reference.py").read_text()
    table = "RULES: dict[str, Rule] = {\n"
    assert reference.count(table) == 1
    reference = reference.replace(
        table, RULE.lstrip("\n") + "\n" + table + '    "vnorm": Rule(score=_vnorm),\n'
    )
    (package / "reference.py").write_text(reference)
    matrix = (tmp_path / "checks" / "matrix.py").read_text()
    cases = "CASES: list[tuple[str, dict]] = [\n"
    assert matrix.count(cases) == 1
    (tmp_path / "checks" / "matrix.py").write_text(matrix.replace(cases, cases + '    ("vnorm", {}),\n'))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "vnorm matches the reference" in out.stdout
