"""Mutation check: inject known bugs one at a time and report which test loops catch them.

Each mutant is a single textual edit of one file of the package. The repository's files (tracked and
untracked, not ignored) are copied to a temporary directory; every mutant is applied there, the test
suite is run there (``python -m pytest`` with the copy as working directory and ``PYTHONPATH``, so the
copy's ``rmm`` is the one imported), and the file is restored. The working tree is never modified.

For every mutant the fast loop (``-m "not slow"``) runs first, with the tests most likely to fail
first and ``-x``; a mutant it misses is then run against the slow tests (``-m slow``), unless
``--fast-only``. A baseline run of the unmutated copy must pass first (``--no-baseline`` skips it).

    python checks/mutation_check.py                 # all mutants, fast loop then slow suite
    python checks/mutation_check.py --fast-only --only rmm_weight_flip freeze_window
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Test files run first (the likeliest to catch a mutant); the other files of tests/ follow, sorted.
FIRST = ["tests/test_policies.py", "tests/test_runner.py", "tests/test_engine.py", "tests/test_reference.py"]
# not run on a copy: it checks that every mutant's text is in the code, which a mutant's copy lacks
SELF_TEST = "tests/test_mutation_check.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    what: str


MUTANTS = [
    Mutant(
        "rmm_weight_flip",
        "rmm/policies/rmm.py",
        "utility = weighted_attention(contribution, weight)",
        "utility = weighted_attention(contribution, weight.flip(0))",
        "rmm: the chunk's query weights applied in reverse order (weight index flipped)",
    ),
    Mutant(
        "rmm_weight_shift",
        "rmm/policies/rmm.py",
        "utility = weighted_attention(contribution, weight)",
        "utility = weighted_attention(contribution, weight.roll(1))",
        "rmm: each query's weight shifted to the next query",
    ),
    Mutant(
        "correct_is_prob",
        "rmm/policies/rmm.py",
        '{"correct": obs.correct, "prob": obs.prob}',
        '{"correct": obs.prob, "prob": obs.prob}',
        "rmm: weight=correct uses p(x_{s+1}|s) (correct swapped for prob)",
    ),
    Mutant(
        "no_sink_rerotation",
        "rmm/integration.py",
        "sink_query = kv_memory.sink_query(layer, q)",
        "sink_query = None",
        "streaming_llm with positions=cache: sinks seen without re-rotating the query to its rank",
    ),
    Mutant(
        "freeze_window",
        "rmm/policies/rmm.py",
        "contribution = contribution * (age <= self.lag)",
        "contribution = contribution * (age < self.lag)",
        "rmm freeze: sums s in [j, j + H) instead of [j, j + H]",
    ),
    Mutant(
        "rank_rotation",
        "rmm/rotary.py",
        "lag[..., None] + torch.arange(retained_pos.shape[-1], device=query_pos.device)",
        "lag[..., None] + torch.arange(1, retained_pos.shape[-1] + 1, device=query_pos.device)",
        "positions=cache, score-based: retained keys rotated to rank + 1",
    ),
    Mutant(
        "oracle_future_reused",
        "rmm/lookahead.py",
        "if self._last is not None and self._last[0] is tokens:",
        "if self._last is not None:",
        "reference pass: the first document's oracle future reused for the next documents",
    ),
    Mutant(
        "tie_to_older",
        "rmm/policies/select.py",
        "order = torch.argsort(key_pos, dim=-1, descending=True, stable=True)",
        "order = torch.argsort(key_pos, dim=-1, descending=False, stable=True)",
        "ranking: ties go to the older position",
    ),
    Mutant(
        "recent_window",
        "rmm/policies/base.py",
        "torch.where(key_pos >= now - recent,",
        "torch.where(key_pos > now - recent,",
        "h2o/random/rmm: protected recent window one position short",
    ),
    Mutant(
        "tova_first_query",
        "rmm/policies/tova.py",
        "return obs.attention[:, :, -1, :].clone()",
        "return obs.attention[:, :, 0, :].clone()",
        "tova: ranks by the chunk's first query instead of its last",
    ),
    Mutant(
        "sinks_off_by_one",
        "rmm/policies/streaming_llm.py",
        "(key_pos[..., None, :] < self.sinks)",
        "(key_pos[..., None, :] <= self.sinks)",
        "streaming_llm: one sink too many",
    ),
    Mutant(
        "capacity",
        "rmm/policies/base.py",
        "self.budget - self.chunk + 1",
        "self.budget - self.chunk + 2",
        "score-based policies keep B - C + 2 (the chunk's last query sees B + 1)",
    ),
    Mutant(
        "gradient_sign",
        "rmm/memory.py",
        "utility = (probs * (reach - per_value)).sum(dim=2)",
        "utility = (probs * (per_value - reach)).sum(dim=2)",
        "rmm weight=gradient: u_s(j) = +dl/dz instead of -dl/dz (the loss derivative's sign)",
    ),
    Mutant(
        "gradient_chunk_detached",
        "rmm/memory.py",
        "return torch.cat([kept, graph_key], dim=2), chunk_values",
        "return torch.cat([kept, graph_key.detach()], dim=2), chunk_values.detach()",
        "rmm weight=gradient: the chunk's own keys and values detached (later queries' losses lost)",
    ),
    Mutant(
        "eager_empty_slots_seen",
        "rmm/masks.py",
        "self.slot_bias = additive((key_pos < 0) & retained)",
        "self.slot_bias = additive((key_pos < -1) & retained)",
        "eager path, score-based: the empty retained slots left unmasked",
    ),
    Mutant(
        "chunk_sees_next_key",
        "rmm/masks.py",
        "return (slot > self.retained + query[:, None])[None, None]",
        "return (slot > self.retained + query[:, None] + 1)[None, None]",
        "eager path, score-based: each query of the chunk sees the next token's key",
    ),
    Mutant(
        "compact_layer_blocks",
        "rmm/memory.py",
        "blocks = [(tensor[i : i + step], rows[i * per_layer : (i + step) * per_layer]) for i in starts]",
        "blocks = [(tensor[i : i + step], rows[: step * per_layer]) for i in starts]",
        "compaction on a CPU in blocks of layers: every block moves the first block's slots",
    ),
    Mutant(
        "carried_state_not_reset",
        "rmm/integration.py",
        "states[index][row] = 0",
        "states[index][row] = states[index][row]",
        "hybrid models: a stream that takes over a batch row starts from the previous stream's state",
    ),
    Mutant(
        "reference_sinks_share",
        "rmm/reference.py",
        "weights = _with_sinks(weights, query, key, attention_mask, scaling, sinks)",
        "weights = weights",
        "the reference: attention weights beside learned sinks not scaled by the keys' share",
    ),
    Mutant(
        "new_stream_sees_old_entries",
        "rmm/memory.py",
        "self.key_pos[:, row] = -1",
        "self.key_pos[:, row] = self.key_pos[:, row]",
        "batch: a stream that takes over a finished stream's row attends that stream's entries",
    ),
    Mutant(
        "new_stream_keeps_old_scores",
        "rmm/memory.py",
        "tensor[:, row] = 0",
        "tensor[:, row] = tensor[:, row]",
        "batch: a stream that takes over a finished stream's row starts from its accumulated scores",
    ),
    Mutant(
        "selfcheck_holds_first_pass",
        "rmm/selfcheck.py",
        "for _ in range(2):  # the first pass is not held",
        "for _ in range(1):  # the first pass is not held",
        "the self-check holds the stream against a process's first forward pass, which may differ",
    ),
    Mutant(
        "load_without_warm_up",
        "rmm/models.py",
        "    warm_vector_math()\n    model, tokenizer = _load(",
        "    model, tokenizer = _load(",
        "load_model does not make the process's first VML call on one thread before the model loads",
    ),
    Mutant(
        "self_check_never_rerun",
        "rmm/engine.py",
        "selfcheck.probe_length(self, tokens.numel()) > self.checked.probe_tokens",
        "False",
        "an engine keeps its first self-check for a later stream that needs a longer probe",
    ),
    Mutant(
        "reference_engine_per_call",
        "rmm/lookahead.py",
        "if batch not in self._engines:",
        "if True:",
        "the reference runner makes a new engine (and self-check) for every batch of documents",
    ),
]


def copy_repository(target: Path) -> None:
    """Copy the files git knows (tracked and untracked, not ignored) into ``target``, links as links (no
    .git: the tests must not need a checkout)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        source = ROOT / rel
        if source.is_symlink():  # rmm/conf -> ../conf: a link, as git keeps it
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            (target / rel).symlink_to(os.readlink(source))
        elif source.is_file():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / rel)


def pytest(copy: Path, marker: str, env: dict) -> tuple[bool, float, str]:
    """Run the suite in ``copy``; returns (passed, seconds, the first failure or the summary line)."""
    rest = sorted(str(p.relative_to(copy)) for p in (copy / "tests").glob("test_*.py"))
    files = FIRST + [f for f in rest if f not in FIRST + [SELF_TEST]]
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", marker, *files]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failures = [line.split(" - ")[0] for line in lines if line.startswith(("FAILED", "ERROR"))]
    last = failures[0] if failures else (lines[-1] if lines else done.stderr[-200:])
    return done.returncode == 0, time.perf_counter() - start, last


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="*", help="mutant names to run (default: all)")
    parser.add_argument("--fast-only", action="store_true", help="do not run the slow suite on survivors")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated fast-loop run")
    parser.add_argument("--check", action="store_true", help="only check that every mutant applies once")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; choose from {[m.name for m in MUTANTS]}")
    if args.check:
        counts = {m.name: (ROOT / m.path).read_text().count(m.old) for m in mutants}
        for name, count in counts.items():
            print(f"{name}: {'applies' if count == 1 else f'pattern found {count} times'}")
        sys.exit(0 if all(count == 1 for count in counts.values()) else 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # still removes the copy
    with tempfile.TemporaryDirectory(prefix="rmm-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        copy_repository(copy)
        env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
        where = subprocess.run(
            [sys.executable, "-c", "import rmm; print(rmm.__file__)"],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not Path(where).resolve().is_relative_to(copy.resolve()):
            sys.exit(f"the copy's tests would import rmm from {where}, not from the copy")
        if not args.no_baseline:
            passed, seconds, last = pytest(copy, "not slow", env)
            outcome = "pass" if passed else "FAIL"
            print(f"baseline fast loop: {outcome} in {seconds:.0f} s ({last})", flush=True)
            if not passed:
                sys.exit("the unmutated fast loop fails: fix that first")
        print("| mutant | injected bug | fast loop | slow suite |\n|---|---|---|---|", flush=True)
        for mutant in mutants:
            path = copy / mutant.path
            original = path.read_text()
            if original.count(mutant.old) != 1:
                print(f"| {mutant.name} | {mutant.what} | pattern not found once in {mutant.path} | |")
                continue
            path.write_text(original.replace(mutant.old, mutant.new))
            try:
                passed, seconds, last = pytest(copy, "not slow", env)
                fast = f"survived ({seconds:.0f} s)" if passed else f"killed ({seconds:.0f} s): {last}"
                slow = "not run"
                if passed and not args.fast_only:
                    passed, seconds, last = pytest(copy, "slow", env)
                    slow = f"survived ({seconds:.0f} s)" if passed else f"killed ({seconds:.0f} s): {last}"
                print(f"| {mutant.name} | {mutant.what} | {fast} | {slow} |", flush=True)
            finally:
                path.write_text(original)


if __name__ == "__main__":
    main()
