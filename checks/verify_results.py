"""Re-run a random sample of committed runs at the current code and compare them token by token.

    python checks/verify_results.py [--seed 0] [--budget-s 600] [--n N] [--per-revision K] [--dirty-only]
        [--revision PREFIX ...] [--out results/cpu/verify_results.md] [ROOT ...]   # make verify-results
    python checks/verify_results.py --batch 4 --per-root 1 --min-docs 2 --budget-s 0 \
        --out results/cpu/verify_batched.md                     # one multi-document run per study, batched

The pool is every complete run directory under the ROOTs (default: the committed studies of ``results/cpu``
but the confirmation, which is sampled apart: ``python checks/verify_results.py results/cpu/confirm/runs
--budget-s 300 --out results/cpu/confirm/verify_results.md``) whose model loads offline (a ``gguf_package``
model whose package is installed, or a local directory that exists; hub models are left out) and whose
estimated cost is at most ``--max-run-s``. A run's estimated cost is its committed ``wall_s`` plus
``reference_wall_s`` plus ``--overhead-s`` (model load and self-check). The pool is shuffled with ``--seed``
and runs are taken in that order while their estimated costs fit ``--budget-s`` (0: no time limit) and at most
``--n`` runs. ``--per-revision K`` samples K runs of every git revision the runs record instead (each
revision's runs shuffled with ``--seed``); ``--dirty-only`` keeps the runs whose revision ends in
``-dirty``; ``--revision PREFIX`` (repeatable) keeps the runs whose revision starts with one of them.

Each sampled run's ``config.yaml`` (the resolved config it ran with) is completed with the defaults of
config keys added since (``rmm.runner.ADDED_KEY_DEFAULTS``), checked to be the configuration that
``resume`` would accept as the same (``rmm.runner.changed_keys`` finds no difference), and run through
``rmm.runner.run`` into a temporary directory (W&B disabled, no progress bar, ``reuse=false``: every
run streams). Its ``token_nll.parquet`` is compared with the committed one document by document
(:func:`rmm.divergence.diverge`): the same tokens in the same order, then per-token NLL within
:data:`rmm.divergence.NLL_BOUND` until the first
difference, which must be explained by a near-tie taken before it (a decision whose margin is below
:data:`~rmm.divergence.TIE_MARGIN`, or a ``correct`` whose margin is below
:data:`~rmm.divergence.CORRECT_MARGIN`; the margins come from the re-run, and from the committed file
where it recorded them). Such a run is a *machine divergence*: another CPU's kernels round the last bits
differently and a near-tied decision went the other way, after which the stream may differ by anything.
A run *fails* (a regression) when its first difference is not explained so, when its tokens differ, or
when it does not run; the script then exits 1. The report gives each run's first divergence, its cause,
and the run-level perplexity committed and now.

``--batch N`` re-runs every sampled run with N documents per forward pass, sampling only runs made at
another batch (``batch`` is no result key, docs/semantics.md); ``--per-root K`` samples K runs from
each root instead of one pool; ``--min-docs D`` takes only runs of at least D documents (so that a batch
holds several).

Writes ``--out`` (atomically): one row per run (run directory, policy, revision, tokens, perplexity
committed and now, max |dNLL| before the first divergence, the divergence and its cause, seconds) with the
command, seed, threads, CPU capability, machine and load.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml
from omegaconf import OmegaConf

from rmm.config import check_run
from rmm.divergence import CORRECT_MARGIN, NLL_BOUND, TIE_MARGIN, Divergence, Trace, diverge
from rmm.files import config_dir
from rmm.runner import ADDED_KEY_DEFAULTS, changed_keys, run
from rmm.storage import (
    METRICS_FILE,
    atomic_write_text,
    git_revision,
    read_config,
    read_metrics,
    read_tokens,
    run_is_complete,
)

REPO = Path(__file__).resolve().parents[1]
ROOTS = [
    "results/cpu/runs",
    "results/cpu/reuse/runs",
    "results/cpu/regimes/runs",
    "results/cpu/natural8k/runs",
    "results/cpu/allocation/runs",
    "results/cpu/estimator",
]
SEED = 0
BUDGET_S = 600.0
OVERHEAD_S = 10.0  # model load (the cached GGUF conversion) and the self-check, per run
OUT = "results/cpu/verify_results.md"
KEY_COLUMNS = ["doc_id", "position", "token_id"]

log = logging.getLogger(__name__)


@dataclass
class Candidate:
    run_dir: Path
    policy: str
    n_tokens: int
    cost_s: float  # estimated from the committed metrics
    n_docs: int = 1
    batch: int = 1  # documents per forward pass it was made with
    revision: str = "unknown"  # the git revision the run records


@dataclass
class Outcome:
    run_dir: Path
    policy: str
    n_tokens: int
    revision: str
    max_diff: float  # largest |dNLL| before the first divergence; inf where the tokens differ or it failed
    divergence: str  # "" where every document agrees; else the first divergent document's, in words
    regression: bool  # a difference no near-tie explains
    ppl_committed: float
    ppl_now: float
    n_correct_differ: int
    seconds: float
    error: str | None = None

    def ok(self) -> bool:
        return self.error is None and not self.regression


def available_offline(model: dict[str, Any]) -> bool:
    """Whether the run's model loads without the hub: a local directory that exists, or an installed
    ``gguf_package`` package."""
    if model.get("path"):
        return Path(model["path"]).is_dir()
    if model.get("source") == "gguf_package":
        return importlib.util.find_spec(model["package"]) is not None
    return False


def pool(roots: Sequence[Path], overhead_s: float, max_run_s: float | None) -> tuple[list[Candidate], dict]:
    """Every complete, offline-loadable run under ``roots`` with its estimated cost; and what was left out."""
    candidates, left_out = [], {"incomplete": 0, "not offline": 0, "too long": 0}
    for root in roots:
        for metrics_file in sorted(Path(root).rglob(METRICS_FILE)):
            run_dir = metrics_file.parent
            if not run_is_complete(run_dir):
                left_out["incomplete"] += 1
                continue
            stored = read_config(run_dir)
            if not available_offline(stored["model"]):
                left_out["not offline"] += 1
                continue
            metrics = read_metrics(run_dir)
            cost = (metrics.get("wall_s") or 0.0) + (metrics.get("reference_wall_s") or 0.0) + overhead_s
            if max_run_s is not None and cost > max_run_s:
                left_out["too long"] += 1
                continue
            n_docs = int(metrics.get("n_docs") or 1)
            revision = str(metrics.get("git_revision") or "unknown")
            candidates.append(
                Candidate(
                    run_dir, str(metrics["policy"]), int(metrics["n_tokens"]), cost, n_docs, revision=revision
                )
            )
    return candidates, left_out


def sample(candidates: list[Candidate], seed: int, budget_s: float, n: int | None) -> list[Candidate]:
    """Shuffled with ``seed``; taken in that order while the estimated costs fit ``budget_s`` (0: no limit),
    at most ``n``."""
    order = sorted(candidates, key=lambda c: str(c.run_dir))
    random.Random(seed).shuffle(order)
    chosen, total = [], 0.0
    for candidate in order:
        if n is not None and len(chosen) >= n:
            break
        if budget_s and total + candidate.cost_s > budget_s:
            continue
        chosen.append(candidate)
        total += candidate.cost_s
    return chosen


def recompose(stored: dict[str, Any]) -> dict[str, Any]:
    """The stored (resolved) config, completed with the defaults of config keys added after it was written
    (a ``policy.`` key only where the policy's own config declares it), for a fresh run without W&B."""
    config = {k: (dict(v) if isinstance(v, dict) else v) for k, v in stored.items()}
    for dotted, value in ADDED_KEY_DEFAULTS.items():
        *parents, key = dotted.split(".")
        if not parents:
            config.setdefault(key, value)
        elif parents == ["policy"]:
            declared = yaml.safe_load(
                (config_dir() / "policy" / f"{config['policy']['name']}.yaml").read_text()
            )
            if key in declared:
                config["policy"].setdefault(key, value)
    changed = changed_keys(stored, config)
    if changed:
        raise ValueError(f"the completed config differs from the stored one in {changed}")
    config["resume"], config["reuse"], config["progress"] = False, False, False
    # a registered run re-made for comparison writes nothing that counts: a dirty tree may re-run it
    config["provenance"] = {**config.get("provenance", {}), "require_clean": False}
    config["wandb"] = {**config.get("wandb", {}), "mode": "disabled"}
    return config


@dataclass
class Comparison:
    """A committed token file against a re-run's: per document, where they first differ and why."""

    same_tokens: bool
    divergences: dict[str, Divergence]
    n_correct_differ: int

    @property
    def max_diff(self) -> float:
        """Largest |dNLL| before each document's first difference (inf where the tokens differ)."""
        if not self.same_tokens:
            return math.inf
        return max((d.max_before for d in self.divergences.values()), default=0.0)

    @property
    def regression(self) -> bool:
        return not self.same_tokens or not all(d.ok for d in self.divergences.values())

    def describe(self) -> str:
        """The first unexplained divergence, else the first explained one, in words ("" when all agree)."""
        if not self.same_tokens:
            return "the tokens differ"
        diverged = [(doc, d) for doc, d in self.divergences.items() if d.first is not None]
        diverged.sort(key=lambda item: item[1].ok)
        return "" if not diverged else f"{diverged[0][0]}: {diverged[0][1].describe()}"


def compare(stored: pd.DataFrame, fresh: pd.DataFrame, score_digits: int | None = None) -> Comparison:
    """The committed tokens ``stored`` against the re-run's ``fresh``: the same tokens in the same order,
    then each document through :func:`rmm.divergence.diverge` (``score_digits``: the policy's)."""
    if len(stored) != len(fresh) or not stored[KEY_COLUMNS].reset_index(drop=True).equals(
        fresh[KEY_COLUMNS].reset_index(drop=True)
    ):
        return Comparison(False, {}, len(stored))
    ca = stored["correct"].astype("boolean").fillna(False).to_numpy(bool)
    cb = fresh["correct"].astype("boolean").fillna(False).to_numpy(bool)
    n_correct_differ = int((ca != cb).sum())
    divergences = {}
    for (doc_id, a), (_, b) in zip(
        stored.groupby("doc_id", sort=False), fresh.groupby("doc_id", sort=False), strict=True
    ):
        divergences[str(doc_id)] = diverge(Trace.of_frame(a, score_digits), Trace.of_frame(b, score_digits))
    return Comparison(True, divergences, n_correct_differ)


def _ppl(tokens: pd.DataFrame) -> float:
    return math.exp(tokens["nll"].astype("float64").mean())


def verify(candidate: Candidate, batch: int | None = None) -> Outcome:
    """Re-run one committed run at the current code (``batch`` documents per pass: None, as it was made)
    into a temporary directory and compare its tokens."""
    start = time.perf_counter()
    try:
        config = recompose(read_config(candidate.run_dir))
        if batch is not None:
            config["batch"] = batch
        cfg = OmegaConf.create(config)
        check_run(cfg)
        with tempfile.TemporaryDirectory(prefix="verify_") as tmp:
            digits = run(cfg, tmp).get("score_digits")
            fresh = read_tokens(tmp)
        stored = read_tokens(candidate.run_dir)
        found = compare(stored, fresh, digits)
        fields = dict(
            max_diff=found.max_diff,
            divergence=found.describe(),
            regression=found.regression,
            ppl_committed=_ppl(stored),
            ppl_now=_ppl(fresh),
            n_correct_differ=found.n_correct_differ,
            error=None,
        )
    except Exception as err:  # a run that no longer runs is a failure to report, not to stop at
        log.exception("%s failed", candidate.run_dir)
        fields = dict(
            max_diff=math.inf,
            divergence="",
            regression=True,
            ppl_committed=math.nan,
            ppl_now=math.nan,
            n_correct_differ=0,
            error=f"{type(err).__name__}: {err}",
        )
    seconds = time.perf_counter() - start
    return Outcome(
        candidate.run_dir, candidate.policy, candidate.n_tokens, candidate.revision, seconds=seconds, **fields
    )


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def report(
    outcomes: list[Outcome],
    args: argparse.Namespace,
    command: str,
    threads: int,
    loads: tuple[tuple[float, ...], tuple[float, ...]],
    pool_size: int,
    left_out: dict,
    estimated_s: float,
    total_s: float,
) -> str:
    failed = [o for o in outcomes if not o.ok()]
    diverged = [o for o in outcomes if o.ok() and o.divergence]
    finite = [o.max_diff for o in outcomes if math.isfinite(o.max_diff)]
    moved = [abs(o.ppl_now / o.ppl_committed - 1) for o in outcomes if o.error is None]
    verdict = "PASS" if not failed and outcomes else "FAIL"
    lines = [
        "# Committed runs re-run at the current code (`make verify-results`)",
        "",
        f"Command: `{command}`  ",
        f"Seed {args.seed}, budget {args.budget_s:g} s of estimated cost, max {args.max_run_s:g} s a run, "
        f"n {args.n if args.n is not None else 'unlimited'}"
        + (f", {args.per_revision} per revision" if args.per_revision else "")
        + (", dirty revisions only" if args.dirty_only else "")
        + (f", revisions {', '.join(args.revision)}" if args.revision else "")
        + f"; batch {args.batch or 'as each run was made'}.  ",
        f"Code: {git_revision()}; torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, threads {threads}; {os.cpu_count()} CPU cores, "
        f"{platform.processor() or platform.machine()} {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}.  ",
        "Load average (1, 5, 15 min) at the start "
        + ", ".join(f"{x:.2f}" for x in loads[0])
        + ", at the end "
        + ", ".join(f"{x:.2f}" for x in loads[1])
        + ".  ",
        f"Pool: {pool_size} runs (left out: "
        + ", ".join(f"{v} {k}" for k, v in left_out.items())
        + f"); sampled {len(outcomes)}, estimated {estimated_s:.0f} s, took {total_s:.0f} s.",
        "",
        f"**{verdict}**: {len(outcomes) - len(failed) - len(diverged)} of {len(outcomes)} runs agree token "
        f"by token within {NLL_BOUND:g}; {len(diverged)} diverge after a near-tie (a machine divergence)"
        + (f"; **{len(failed)} failed**" if failed else "")
        + f". Largest |dNLL| before a divergence {max(finite) if finite else float('nan'):.3g}; largest "
        f"run-level perplexity change {max(moved) if moved else float('nan'):.2%} (the studies' smallest "
        "reported effect is a paired ratio of 0.99).",
        "",
        f"Bounds (rmm/divergence.py): per-token NLL {NLL_BOUND:g} while the decisions agree; a decision is "
        f"a near-tie below a relative margin of {TIE_MARGIN:g}, `correct` below a top-1/top-2 "
        f"log-probability gap of {CORRECT_MARGIN:g}. A divergence no near-tie explains is a regression.",
        "",
        "| run dir | policy | revision | tokens | ppl committed | ppl now | max \\|dNLL\\| before | "
        "first divergence | seconds |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for o in outcomes:
        diff = f"{o.max_diff:.2e}" if math.isfinite(o.max_diff) else "inf"
        flag = "" if o.ok() else " **FAIL**"
        lines.append(
            f"| {_relative(o.run_dir)} | {o.policy} | {_short(o.revision)} | {o.n_tokens} "
            f"| {o.ppl_committed:.5f} | {o.ppl_now:.5f} | {diff}{flag} "
            f"| {_cell(o.divergence) or 'none'} | {o.seconds:.0f} |"
        )
    for o in outcomes:
        if o.error:
            lines += ["", f"{_relative(o.run_dir)}: {o.error}"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """``text`` for a markdown table cell (pipes escaped)."""
    return text.replace("|", "\\|")


def _short(revision: str) -> str:
    """A revision as the docs cite it: 7 hex digits, and ``-dirty`` where recorded."""
    return revision[:7] + ("-dirty" if revision.endswith("-dirty") else "")


def per_revision(candidates: list[Candidate], k: int, seed: int, budget_s: float) -> list[Candidate]:
    """``k`` runs of every recorded revision (:func:`sample` within each), in revision order."""
    revisions = sorted({c.revision for c in candidates})
    return [
        c
        for revision in revisions
        for c in sample([c for c in candidates if c.revision == revision], seed, budget_s, k)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("roots", nargs="*", type=Path, help=f"run roots (default: {' '.join(ROOTS)})")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="estimated seconds in all (0: no limit)"
    )
    parser.add_argument(
        "--max-run-s", type=float, default=None, help="longest run taken (default: budget / 4)"
    )
    parser.add_argument("--n", type=int, default=None, help="at most this many runs")
    parser.add_argument("--overhead-s", type=float, default=OVERHEAD_S)
    parser.add_argument("--per-revision", type=int, default=None, help="sample this many runs per revision")
    parser.add_argument("--dirty-only", action="store_true", help="only runs recording a -dirty revision")
    parser.add_argument("--revision", action="append", default=[], help="only runs of this revision prefix")
    parser.add_argument("--out", type=Path, default=Path(OUT))
    parser.add_argument("--batch", type=int, default=None, help="documents per forward pass of the re-runs")
    parser.add_argument("--per-root", type=int, default=None, help="sample this many runs from each root")
    parser.add_argument("--min-docs", type=int, default=1, help="only runs of at least this many documents")
    args = parser.parse_args(argv)
    if args.max_run_s is None:
        args.max_run_s = args.budget_s / 4 if args.budget_s else math.inf
    roots = args.roots or [REPO / root for root in ROOTS]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = shlex.join(
        ["python", "checks/verify_results.py", *(argv if argv is not None else sys.argv[1:])]
    )
    loads_start = os.getloadavg()
    candidates, left_out = pool(
        roots, args.overhead_s, args.max_run_s if math.isfinite(args.max_run_s) else None
    )
    candidates = [c for c in candidates if c.n_docs >= args.min_docs]
    if args.dirty_only:
        candidates = [c for c in candidates if c.revision.endswith("-dirty")]
    if args.revision:
        candidates = [c for c in candidates if c.revision.startswith(tuple(args.revision))]
    if args.batch is not None:  # against runs made at another batch (those made one document per pass)
        candidates = [c for c in candidates if c.batch != args.batch]
    if args.per_revision is not None:
        chosen = per_revision(candidates, args.per_revision, args.seed, args.budget_s)
    elif args.per_root is None:
        chosen = sample(candidates, args.seed, args.budget_s, args.n)
    else:  # each root sampled apart
        chosen = [
            c
            for root in roots
            for c in sample(
                [c for c in candidates if Path(root) in c.run_dir.parents],
                args.seed,
                args.budget_s,
                args.per_root,
            )
        ]
    estimated = sum(c.cost_s for c in chosen)
    print(f"{len(chosen)} of {len(candidates)} runs, estimated {estimated:.0f} s", flush=True)
    start, outcomes = time.perf_counter(), []
    for i, candidate in enumerate(chosen, 1):
        outcome = verify(candidate, args.batch)
        outcomes.append(outcome)
        print(
            f"[{i}/{len(chosen)}] {_relative(candidate.run_dir)}: max |dNLL| {outcome.max_diff:.3g}, "
            f"{outcome.divergence or 'agree'}, {outcome.seconds:.0f} s "
            f"(estimated {candidate.cost_s:.0f})",
            flush=True,
        )
    text = report(
        outcomes,
        args,
        command,
        torch.get_num_threads(),
        (loads_start, os.getloadavg()),
        len(candidates),
        left_out,
        estimated,
        time.perf_counter() - start,
    )
    atomic_write_text(args.out, text)
    print(text)
    return 0 if outcomes and all(o.ok() for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
