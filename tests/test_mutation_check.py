"""The mutation check's mutants still apply to the code they are meant to break."""

from __future__ import annotations

from checks.mutation_check import MUTANTS, ROOT


def test_every_mutant_applies_to_the_current_code():
    """Each mutant edits one exact text; it must occur exactly once, or the mutant silently tests nothing."""
    assert len({mutant.name for mutant in MUTANTS}) == len(MUTANTS)
    for mutant in MUTANTS:
        text = (ROOT / mutant.path).read_text()
        assert text.count(mutant.old) == 1, f"{mutant.name}: {mutant.old!r} not found once in {mutant.path}"
