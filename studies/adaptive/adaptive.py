"""The adaptive-lag confirmation's verdicts (docs/adaptive_lag.md, "Registration"): lag=auto against h2o, the
named fixed lag and the smoother, by the registered rules.

    python -m studies.adaptive.adaptive results/cpu/adaptive/runs --out results/cpu/adaptive
    python -m studies.adaptive.adaptive --settings smollm2_135m  # the settings' arms and overrides

For each registered (setting, model) of ``studies/adaptive/adaptive_predictions.yaml`` and each natural-text
budget: d_s(b, a), the mean NLL_b - NLL_a over replicate s (a generator seed's recall code tokens, its streams
pooled; on natural text a play's tokens), then P1 (lag=auto against h2o), P2 (auto's log-gain minus the
registered share of the named lag's), P3 (auto against h2o's perplexity times the registered bound) as
two-sided t-tests with Holm over each model's P1-P3, and P4 (auto's share of the smoother's log-gain) as a
ratio of the mean differences with the nested bootstrap of the regime map. A prediction whose runs are
missing for some replicate is listed as pending. Writes ``verdicts.csv``, ``verdicts.md`` and
``figures/chosen_lag.png`` (the lag chosen against stream position) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rmm.analysis.bootstrap import N_RESAMPLES, paired_tokens
from rmm.analysis.collect import collect
from rmm.analysis.seeds import (
    FACTOR_KEYS,
    SEED_COLUMN,
    arm,
    holm,
    percentile_interval,
    pooled_pairs,
    seed_replicates,
    t_summary,
)
from rmm.storage import atomic_write_text, read_tokens

DESIGN = Path(__file__).with_name("adaptive_predictions.yaml")
AUTO, FIXED, H2O, SMOOTHER = "auto", "fixed", "h2o", "smoother"


def registered() -> dict:
    """The registered design (read only)."""
    return yaml.safe_load(DESIGN.read_text())


def arms(entry: dict) -> list[str]:
    """A (setting, model)'s arms: h2o and auto; the named lag where a fixed lag wins; the smoother where it
    runs."""
    out = [H2O, AUTO]
    if entry["class"] == "fixed_wins":
        out.append(f"{FIXED}{entry['lag']}")
    return out + ([SMOOTHER] if entry.get("smoother") else [])


def setting_lines(model: str) -> list[str]:
    """Per setting of ``model`` in the registered order: ``NAME ARM,ARM,... OVERRIDE ...`` (adaptive.sh)."""
    lines = []
    for name, setting in registered()["settings"].items():
        if model in setting:
            factors = " ".join(f"{FACTOR_KEYS[k]}={v}" for k, v in setting["factors"].items())
            lines.append(f"{name} {','.join(arms(setting[model]))} {factors}")
    return lines


def run_arm(row: pd.Series) -> str | None:
    """The study's arm of a run: auto, fixed<lag> (rmm correct, accumulate), h2o, smoother, or None."""
    if row["policy"] == "rmm" and pd.isna(row["lag"]):  # lag=auto records no lag
        return AUTO
    name = arm(row)
    if name == "rmm_correct":
        return f"{FIXED}{int(row['lag'])}"
    return name if name in (H2O, SMOOTHER) else None


def cell_runs(frame: pd.DataFrame, model: str, factors: dict) -> dict[str, dict[int, str]]:
    """The runs of one (setting, model): arm -> generator seed -> run directory."""
    rows = frame[frame["model"] == model]
    for short, value in factors.items():
        rows = rows[rows[FACTOR_KEYS[short]] == value]
    runs: dict[str, dict[int, str]] = {}
    for _, row in rows.iterrows():
        if row["study_arm"] is not None:
            runs.setdefault(row["study_arm"], {})[int(row[SEED_COLUMN])] = row["run_dir"]
    return runs


def seed_differences(runs: dict[str, dict[int, str]], b: str, a: str, seeds: list[int]) -> pd.DataFrame:
    """Recall tokens of (b, a) paired and pooled over ``seeds``, with ``diff`` = NLL_b - NLL_a."""
    tokens = pooled_pairs([(seed, runs[a][seed], runs[b][seed]) for seed in seeds])
    return tokens.assign(diff=tokens["nll_b"] - tokens["nll_a"])


def play_differences(run_b: str, run_a: str) -> pd.DataFrame:
    """Natural text: every token of (b, a) paired, ``seed`` the play, with ``diff`` = NLL_b - NLL_a."""
    tokens = paired_tokens(read_tokens(run_a), read_tokens(run_b))
    return tokens.assign(seed=tokens["doc_id"], doc=tokens["doc_id"], diff=tokens["nll_b"] - tokens["nll_a"])


def tested(diff: pd.DataFrame, shift: float = 0.0) -> dict[str, float]:
    """``t_summary`` of the per-replicate means of ``diff`` [tokens] minus ``shift``, with the count of
    replicates and of those below ``shift``."""
    per = diff.groupby("seed", sort=False)["diff"].mean().to_numpy() - shift
    return {**t_summary(per), "replicates": int(per.size), "below": int((per < 0).sum())}


def aligned(diffs: dict[str, pd.DataFrame]) -> None:
    """Refuse paired differences that do not hold the same tokens in the same order."""
    first = next(iter(diffs.values()))
    for name, diff in diffs.items():
        if not (diff[["doc", "position"]].to_numpy() == first[["doc", "position"]].to_numpy()).all():
            raise ValueError(f"the {name} differences are not paired with auto's tokens")


def predictions(entry: dict, diffs: dict[str, pd.DataFrame], block: int, n_resamples: int) -> list[dict]:
    """The registered tests of one (setting, model) or natural-text budget, from per-token differences against
    h2o ``diffs`` (auto, and fixed or smoother where they ran), in the same tokens and order."""
    design, auto = registered(), diffs[AUTO]
    aligned(diffs)
    rows = [{"prediction": "P1", **tested(auto)}]
    if entry["class"] == "fixed_wins":
        gain = auto.assign(diff=auto["diff"] - design["share"] * diffs[FIXED]["diff"].to_numpy())
        fixed = tested(diffs[FIXED])
        share = tested(auto)["log_ratio"] / fixed["log_ratio"]
        rows.append({"prediction": "P2", **tested(gain), "fixed_ratio": fixed["ratio"], "share": share})
    if entry["class"] == "every_lag_loses":
        rows.append({"prediction": "P3", **tested(auto, float(np.log(design["within"])))})
    if SMOOTHER in diffs:
        smoother = diffs[SMOOTHER]["diff"].to_numpy()
        replicates = [
            seed_replicates(v, auto, block, n_resamples) for v in (auto["diff"].to_numpy(), smoother)
        ]
        low, high = percentile_interval(replicates[0] / replicates[1])
        share = float(auto["diff"].mean() / smoother.mean())
        rows.append({"prediction": "P4", "share": share, "share_low": low, "share_high": high})
    return rows


def verdict(row: pd.Series, alpha: float) -> str:
    """The registered rule (docs/adaptive_lag.md, "Predictions")."""
    if row["prediction"] == "P4":
        return "reported"
    rejected = row["p_holm"] < alpha
    if row["prediction"] == "P1":
        return "refuted" if rejected and row["log_ratio"] > 0 else "holds"
    if not rejected:
        return "unresolved"
    return "confirmed" if row["log_ratio"] < 0 else "refuted"


def planned(entry: dict) -> list[str]:
    """The predictions registered for a (setting, model) or natural-text budget ``entry``."""
    kind = {"fixed_wins": ["P2"], "every_lag_loses": ["P3"]}.get(entry["class"], [])
    return ["P1", *kind, *(["P4"] if entry.get("smoother") else [])]


def pending(head: dict, entry: dict, why: str) -> list[dict]:
    """One pending row per registered prediction of ``entry``."""
    return [{**head, "prediction": name, "verdict": f"pending ({why})"} for name in planned(entry)]


def cell_rows(frame: pd.DataFrame, n_resamples: int) -> list[dict]:
    """Every registered (setting, model)'s predictions on the reuse streams, or one pending row each."""
    design, rows = registered(), []
    seeds = design["seeds"]
    for name, setting in design["settings"].items():
        for model, entry in setting.items():
            if model == "factors":
                continue
            head = {"model": model, "setting": name, "class": entry["class"]}
            runs = cell_runs(frame, model, setting["factors"]) if "model" in frame else {}
            have = min(sum(seed in runs.get(x, {}) for seed in seeds) for x in arms(entry))
            if have < len(seeds):
                rows += pending(head, entry, f"{have} of {len(seeds)} seeds")
                continue
            diffs = {
                name.rstrip("0123456789"): seed_differences(runs, name, H2O, seeds)
                for name in arms(entry)[1:]
            }
            block = int(frame["dataset.code_tokens"].dropna().iloc[0])
            rows += [{**head, **row} for row in predictions(entry, diffs, block, n_resamples)]
    return rows


def natural_runs(root: Path, budget: int) -> dict[str, str]:
    """arm -> run directory of the committed or new natural-text runs under ``root`` at ``budget``."""
    frame = collect([root], intervals=False) if root.is_dir() else pd.DataFrame()
    if frame.empty:
        return {}
    frame = frame[frame["budget"] == budget]
    lag = registered()["natural"]["lag"]
    return {
        name: row["run_dir"]
        for _, row in frame.iterrows()
        if (name := run_arm(row)) in (AUTO, H2O, SMOOTHER, f"{FIXED}{lag}")
    }


def natural_rows(root: Path, n_resamples: int) -> list[dict]:
    """Natural text, per model and budget: lag=auto's runs under ``root``, the others committed."""
    natural, rows = registered()["natural"], []
    for model, committed in natural["runs"].items():
        for budget, kind in natural["budgets"].items():
            entry = {"class": kind, "smoother": True}
            head = {"model": model, "setting": f"natural B={budget}", "class": kind}
            runs = {**natural_runs(Path(committed) / model, budget), **natural_runs(root / model, budget)}
            if AUTO not in runs:
                rows += pending(head, entry, "no lag=auto run")
                continue
            fixed = f"{FIXED}{natural['lag']}"
            diffs = {AUTO: play_differences(runs[AUTO], runs[H2O])}
            if kind == "fixed_wins":
                diffs[FIXED] = play_differences(runs[fixed], runs[H2O])
            diffs[SMOOTHER] = play_differences(runs[SMOOTHER], runs[H2O])
            rows += [{**head, **row} for row in predictions(entry, diffs, 256, n_resamples)]
    return rows


def verdicts(cells: pd.DataFrame, natural_root: Path, n_resamples: int = N_RESAMPLES) -> pd.DataFrame:
    """From the reuse runs ``cells`` (with their ``study_arm``) and lag=auto's natural-text runs under
    ``natural_root``: every registered prediction with its figures and verdict; Holm over each model's
    P1-P3 (a pending prediction counts with p = 1, which bounds the final adjusted p from above)."""
    table = pd.DataFrame(cell_rows(cells, n_resamples) + natural_rows(natural_root, n_resamples))
    models = list(dict.fromkeys(table["model"]))  # each model's rows together, in the registered order
    table = table.sort_values("model", key=lambda m: m.map(models.index), kind="stable", ignore_index=True)
    alpha = registered()["alpha"]
    if "p" not in table:
        return table
    for _, group in table[table["prediction"] != "P4"].groupby("model"):
        table.loc[group.index, "p_holm"] = holm(group["p"].fillna(1.0).tolist())
    for _, group in table.groupby("model"):
        complete = bool(group["verdict"].isna().all()) if "verdict" in group else True
        for index in group.index[group["verdict"].isna()] if "verdict" in group else group.index:
            outcome = verdict(table.loc[index], alpha)
            if not complete and outcome in ("holds", "unresolved"):
                outcome += " (provisional: family incomplete)"
            table.loc[index, "verdict"] = outcome
    return table


def chosen_lag(run_dirs: list[str], bin_tokens: int = 64) -> pd.Series:
    """The mean lag chosen by lag=auto's (layer, KV head) against stream position (h2o counted as lag 0),
    over the runs' documents, in ``bin_tokens``-token bins: position bin start -> mean lag."""
    points = []
    for run_dir in run_dirs:
        record = json.loads((Path(run_dir) / "metrics.json").read_text())["lag_auto"]
        lags = np.array([0 if a == H2O else a for a in record["arms"]], dtype=np.float64)
        for boundaries, counts in zip(record["boundaries"], record["counts"], strict=True):
            if counts:
                counts = np.asarray(counts, dtype=np.float64)  # [K, arms]
                points.append(
                    pd.DataFrame({"position": boundaries, "lag": counts @ lags / counts.sum(axis=1)})
                )
    if not points:
        return pd.Series(dtype=np.float64)
    frame = pd.concat(points)
    return frame.groupby(frame["position"] // bin_tokens * bin_tokens)["lag"].mean()


def figure(curves: dict[str, dict[str, pd.Series]], out: Path) -> None:
    """One panel per model: the chosen lag against stream position, one line per setting."""
    fig = Figure(figsize=(6.4 * len(curves), 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (model, lines) in zip(
        fig.subplots(1, len(curves), squeeze=False)[0], curves.items(), strict=True
    ):
        for label, curve in lines.items():
            ax.plot(curve.index, curve.to_numpy(), label=label, linewidth=1.2)
        ax.set(title=model, xlabel="stream position (tokens)", ylabel="mean chosen lag (h2o = 0)")
        ax.legend(fontsize=7, ncol=2)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "chosen_lag.png", dpi=150)


def lag_curves(cells: pd.DataFrame, natural_root: Path) -> dict[str, dict[str, pd.Series]]:
    """model -> setting -> chosen-lag curve, for every lag=auto run there is."""
    curves: dict[str, dict[str, pd.Series]] = {}
    for name, setting in registered()["settings"].items():
        for model in (m for m in setting if m != "factors" and "model" in cells):
            runs = cell_runs(cells, model, setting["factors"]).get(AUTO, {})
            if runs:
                curves.setdefault(model, {})[f"{name} ({len(runs)} seeds)"] = chosen_lag(list(runs.values()))
    for model in registered()["natural"]["runs"]:
        for budget in registered()["natural"]["budgets"]:
            run = natural_runs(natural_root / model, budget).get(AUTO)
            if run:
                curves.setdefault(model, {})[f"natural B={budget}"] = chosen_lag([run], 512)
    return curves


READS = {
    "P1": "auto / h2o",
    "P2": "exp(d_auto - {share} d_fixed)",
    "P3": "auto / h2o / {within}",
    "P4": "auto's share of the smoother's log-gain",
}


def figures_of(row: pd.Series) -> list[str]:
    """The table cells of one tested row: what it reads, value [interval], Holm p, replicates below."""
    design = registered()
    reads = READS[row["prediction"]].format(share=design["share"], within=design["within"])
    if row["prediction"] == "P4":
        return [reads, f"{row['share']:.2f} [{row['share_low']:.2f}, {row['share_high']:.2f}]", "", ""]
    value = f"{row['ratio']:.3f} [{row['ratio_low95']:.3f}, {row['ratio_high95']:.3f}]"
    if row["prediction"] == "P2":
        value += f"; fixed / h2o {row['fixed_ratio']:.3f}, share {row['share']:.2f}"
    return [reads, value, f"{row['p_holm']:.3g}", f"{int(row['below'])}/{int(row['replicates'])}"]


def markdown(table: pd.DataFrame) -> str:
    """The verdict table in the registered order, and the count of verdicts per model."""
    lines = [
        '# The adaptive-lag confirmation: verdicts (docs/adaptive_lag.md, "Registration")',
        "",
        "d = per replicate (a generator seed's recall code tokens, its 4 streams pooled; on natural text",
        "a play's tokens) the mean NLL difference; values are exp(mean) with the 95 % t-interval over the",
        "replicates, p the two-sided t-test Holm-adjusted over the model's P1-P3 (pending predictions count",
        "with p = 1); below: the replicates whose tested difference is below 0. P4: the share with the",
        "regime map's nested bootstrap.",
        "",
        "| model | setting | class | prediction | reads | value [95 % interval] | Holm p | below | verdict |",
        "|---|---|---|---|---|---|---:|---:|---|",
    ]
    for _, row in table.iterrows():
        cells = figures_of(row) if not str(row["verdict"]).startswith("pending") else ["", "", "", ""]
        lines.append(
            "| "
            + " | ".join(
                [row["model"], row["setting"], row["class"], row["prediction"], *cells, row["verdict"]]
            )
            + " |"
        )
    lines.append("")
    for model, rows in table.groupby("model", sort=False):
        counts = rows["verdict"].str.split(" ").str[0].value_counts()
        lines.append(
            f"Verdicts, {model} ({len(rows)} predictions): "
            + ", ".join(f"{k} {v}" for k, v in counts.items())
            + "."
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "runs", nargs="?", type=Path, help="the study's reuse runs (results/cpu/adaptive/runs)"
    )
    parser.add_argument(
        "--natural", type=Path, help="lag=auto's natural-text runs (default: RUNS/../natural8k/runs)"
    )
    parser.add_argument("--out", type=Path, help="write verdicts.csv, verdicts.md and figures/ here")
    parser.add_argument(
        "--settings", metavar="MODEL", help="print the settings' arms and overrides for MODEL and stop"
    )
    parser.add_argument("--n-resamples", type=int, default=N_RESAMPLES)
    args = parser.parse_args(argv)
    if args.settings:
        print("\n".join(setting_lines(args.settings)))
        return 0
    if args.runs is None or args.out is None:
        parser.error("give the runs directory and --out (or --settings MODEL)")
    natural = args.natural or args.runs.parent / "natural8k" / "runs"
    cells = collect([args.runs], intervals=False) if args.runs.is_dir() else pd.DataFrame()
    if not cells.empty:
        cells = cells.assign(study_arm=cells.apply(run_arm, axis=1))
    table = verdicts(cells, natural, args.n_resamples)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "verdicts.csv", index=False)
    atomic_write_text(args.out / "verdicts.md", markdown(table))
    curves = lag_curves(cells, natural)
    if curves:
        figure(curves, args.out / "figures")
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
