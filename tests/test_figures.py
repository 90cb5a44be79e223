"""Collecting runs, the main table, the figures and the notebook, on SYNTHETIC runs (not measurements)."""

from __future__ import annotations

import logging
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest

from rmm.analysis import collect as collect_cli
from rmm.analysis import figures
from rmm.analysis.collect import collect, load_runs, main_table, with_labels, write_csv
from tests.fixtures.results import synthetic
from tests.fixtures.results.synthetic import BUDGETS, LAGS, expected_ppl, make_synthetic_results

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "figures.ipynb"
N_RUNS = 1 + len(BUDGETS) * (len(synthetic.POLICIES) + len(LAGS) * len(synthetic.WEIGHTS))
FIGURE_NAMES = [
    "ppl_vs_budget",
    "ratio_vs_budget",
    "ppl_vs_lag",
    "cumulative_ppl",
    "throughput_memory",
    "measure_vs_accumulate",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic runs plus one interrupted run (tokens and config, no metrics.json) with Hydra and W&B
    folders inside."""
    root = tmp_path_factory.mktemp("results")
    runs = make_synthetic_results(root / "runs")
    partial = root / "runs" / "interrupted"
    partial.mkdir()
    for name in ("config.yaml", "token_nll.parquet"):
        (partial / name).write_bytes((runs[0] / name).read_bytes())
    for nested in (".hydra", "wandb/offline-run-x/files"):  # their config.yaml files are not runs
        (partial / nested).mkdir(parents=True)
        (partial / nested / "config.yaml").write_text("synthetic: true\n")
    return root


@pytest.fixture(scope="module")
def runs(results: Path) -> pd.DataFrame:
    return collect([results / "runs"])


@pytest.fixture(scope="module")
def runs_csv(results: Path, runs: pd.DataFrame) -> Path:
    csv = results / "runs.csv"
    write_csv(runs, csv)
    return csv


@pytest.fixture(scope="module")
def drawn(runs: pd.DataFrame, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """Every figure with its defaults, drawn and saved once (make_all) for the tests that read them,
    and the folder they are saved in."""
    out_dir = tmp_path_factory.mktemp("figures")
    return figures.make_all(runs, out_dir), out_dir


def ppl_of(frame: pd.DataFrame, **where: object) -> float:
    mask = np.ones(len(frame), dtype=bool)
    for column, value in where.items():
        mask &= (frame[column] == value).to_numpy()
    assert mask.sum() == 1, where
    return float(frame.loc[mask, "ppl"].iloc[0])


def test_collect_one_row_per_complete_run(results: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        frame = collect([results / "runs", results / "runs" / "synthetic-lm"])  # overlapping roots
    assert len(frame) == N_RUNS and frame["run_dir"].is_unique
    assert "ignored 1 incomplete run directories" in caplog.text and "interrupted" in caplog.text
    for column in ["ppl", "policy", "budget", "lag", "seed", "tokens_per_s", "correct_frac", "run_dir"]:
        assert column in frame.columns
    for column in [
        "policy.lag",
        "policy.weight",
        "policy.after_commit",
        "policy.rho",
        "package_versions.torch",
    ]:
        assert column in frame.columns
    assert frame.columns[-1] == "run_dir" and all(Path(p).is_absolute() for p in frame["run_dir"])
    assert ppl_of(frame, policy="h2o", budget=64) == pytest.approx(expected_ppl("h2o", 64), rel=1e-5)
    rmm = dict(policy="rmm", budget=128, lag=16, **{"policy.weight": "prob"})
    assert ppl_of(frame, **rmm) == pytest.approx(expected_ppl("rmm", 128, 16, "prob"), rel=1e-5)
    assert frame["policy.rho"].dropna().tolist() == [0.5, 0.5]
    pd.testing.assert_frame_equal(frame, collect([results / "runs"]))  # deterministic
    keys = list(zip(frame["policy"], frame["budget"], frame["lag"], strict=True))
    assert keys == sorted(keys)


def test_collect_of_nothing(tmp_path: Path) -> None:
    assert collect([tmp_path, tmp_path / "missing"]).empty


def test_csv_round_trip_keeps_run_dirs(runs: pd.DataFrame, runs_csv: Path) -> None:
    raw = pd.read_csv(runs_csv)
    assert not any(Path(p).is_absolute() for p in raw["run_dir"])  # portable: relative to the CSV
    loaded = load_runs(runs_csv)
    assert loaded["run_dir"].tolist() == runs["run_dir"].tolist()
    assert loaded["ppl"].to_numpy() == pytest.approx(runs["ppl"].to_numpy())


def test_labels_name_only_varying_parameters(runs: pd.DataFrame) -> None:
    labels = set(with_labels(runs)["label"])
    assert {"full", "window", "streaming_llm", "h2o", "oracle"} <= labels
    assert "rmm (lag=16, weight=correct)" in labels and "rmm (lag=64, weight=prob)" in labels
    assert len(labels) == 5 + len(LAGS) * len(synthetic.WEIGHTS)


def test_main_table(runs: pd.DataFrame) -> None:
    lines = main_table(runs).strip().splitlines()
    assert lines[0] == "| policy | B=64 | B=128 |"  # full's own budget (256) adds no column
    rows = {line.split(" | ")[0].removeprefix("| "): line.strip("| ").split(" | ")[1:] for line in lines[2:]}
    assert rows["full"] == ["18.00", "18.00"]
    assert rows["window"] == [f"{expected_ppl('window', b):.2f}" for b in BUDGETS]
    assert rows["rmm (lag=64, weight=correct)"] == [
        f"{expected_ppl('rmm', b, 64, 'correct'):.2f}" for b in BUDGETS
    ]
    order = [line.split(" | ")[0].removeprefix("| ") for line in lines[2:]]
    assert (
        order[0] == "full"
        and order[-1] == "oracle"
        and order.index("h2o") < order.index("rmm (lag=16, weight=correct)")
    )


def test_main_table_missing_cells_and_empty(runs: pd.DataFrame) -> None:
    frame = runs[~((runs["policy"] == "h2o") & (runs["budget"] == 128))]
    h2o = next(line for line in main_table(frame).splitlines() if line.startswith("| h2o |"))
    assert h2o == f"| h2o | {expected_ppl('h2o', 64):.2f} | – |"
    assert main_table(runs.iloc[0:0]) == "_no runs_\n"


def test_collect_cli(results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, table = tmp_path / "cpu" / "runs.csv", tmp_path / "cpu" / "main_table.md"
    assert collect_cli.main([str(results / "runs"), "--out", str(out), "--table", str(table)]) == 0
    assert len(pd.read_csv(out)) == N_RUNS
    assert table.read_text().startswith("| policy | B=64 | B=128 |")
    assert f"{N_RUNS} complete runs" in capsys.readouterr().out
    assert collect_cli.main([str(tmp_path / "empty")]) == 1


def assert_saved(out_dir: Path, name: str) -> None:
    png, pdf = out_dir / f"{name}.png", out_dir / f"{name}.pdf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert pdf.read_bytes()[:5] == b"%PDF-"


def lines_by_label(ax: object) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {
        line.get_label(): (np.asarray(line.get_xdata()), np.asarray(line.get_ydata())) for line in ax.lines
    }


def test_ppl_vs_budget(drawn: tuple[dict, Path]) -> None:
    fig = drawn[0]["ppl_vs_budget"]
    assert_saved(drawn[1], "ppl_vs_budget")
    lines = lines_by_label(fig.axes[0])
    assert set(lines) == {
        "window",
        "streaming_llm",
        "h2o",
        "oracle",
        "rmm (lag=16)",
        "rmm (lag=64)",
        "full (no eviction)",
    }
    x, y = lines["h2o"]
    assert x.tolist() == list(BUDGETS)
    assert y == pytest.approx([expected_ppl("h2o", b) for b in BUDGETS], rel=1e-5)
    assert lines["rmm (lag=64)"][1] == pytest.approx(
        [expected_ppl("rmm", b, 64, "correct") for b in BUDGETS], rel=1e-5
    )
    assert lines["full (no eviction)"][1][0] == pytest.approx(synthetic.FULL_PPL, rel=1e-5)
    assert "weight=correct" in fig.axes[0].get_title()


def test_ppl_vs_lag(runs: pd.DataFrame, drawn: tuple[dict, Path], tmp_path: Path) -> None:
    fig = drawn[0]["ppl_vs_lag"]
    assert_saved(drawn[1], "ppl_vs_lag")
    ax = fig.axes[0]
    assert "B=128" in ax.get_title()  # the largest budget with several lags
    lines = lines_by_label(ax)
    assert set(lines) == {"rmm weight=correct", "rmm weight=prob", "h2o", "oracle"}
    x, y = lines["rmm weight=prob"]
    assert x.tolist() == list(LAGS)
    assert y == pytest.approx([expected_ppl("rmm", 128, lag, "prob") for lag in LAGS], rel=1e-5)
    assert lines["oracle"][1][0] == pytest.approx(expected_ppl("oracle", 128), rel=1e-5)
    fixed = figures.ppl_vs_lag(runs, tmp_path / "b64", budget=64)
    assert lines_by_label(fixed.axes[0])["h2o"][1][0] == pytest.approx(expected_ppl("h2o", 64), rel=1e-5)
    assert figures.ppl_vs_lag(runs, tmp_path / "none", budget=1024) is None


def test_cumulative_ppl(runs: pd.DataFrame, tmp_path: Path) -> None:
    fig = figures.cumulative_ppl(runs, tmp_path, bins=16)
    assert_saved(tmp_path, "cumulative_ppl")
    ax = fig.axes[0]
    assert "B=64" in ax.get_title()  # every policy runs at 64 and 128: the smaller one
    lines = lines_by_label(ax)
    assert set(lines) == {"full", "window", "streaming_llm", "h2o", "oracle", "rmm (lag=64, weight=correct)"}
    for label, (policy, lag, weight) in {
        "full": ("full", None, None),
        "h2o": ("h2o", None, None),
        "rmm (lag=64, weight=correct)": ("rmm", 64, "correct"),
    }.items():
        x, y = lines[label]
        assert len(x) == 16 and x[-1] == synthetic.DOC_LEN
        assert y[-1] == pytest.approx(expected_ppl(policy, 64, lag, weight), rel=1e-4)  # all tokens pooled


def test_throughput_memory(drawn: tuple[dict, Path]) -> None:
    fig = drawn[0]["throughput_memory"]
    assert_saved(drawn[1], "throughput_memory")
    speed, memory = (lines_by_label(ax) for ax in fig.axes[:2])
    assert speed["h2o"][1] == pytest.approx([synthetic.tokens_per_s("h2o", b) for b in BUDGETS])
    assert speed["full (no eviction)"][1][0] == pytest.approx(synthetic.tokens_per_s("full", 256))
    assert memory["oracle"][1] == pytest.approx(
        [synthetic.peak_memory_bytes("oracle", b) / 2**20 for b in BUDGETS]
    )


def test_measure_vs_accumulate(runs: pd.DataFrame, drawn: tuple[dict, Path]) -> None:
    fig = drawn[0]["measure_vs_accumulate"]
    assert_saved(drawn[1], "measure_vs_accumulate")
    ax, twin = fig.axes
    lines = lines_by_label(ax)
    for lag in LAGS:
        gap = [expected_ppl("rmm", b, lag, "correct") - expected_ppl("h2o", b) for b in BUDGETS]
        assert lines[f"rmm − h2o, lag={lag}"][1] == pytest.approx(gap, abs=1e-3)
    rmm = runs[(runs["policy"] == "rmm") & (runs["policy.weight"] == "correct")]
    frac = rmm.groupby("budget")["correct_frac"].mean()
    assert twin.lines[0].get_ydata() == pytest.approx(frac.to_numpy())
    assert twin.get_ylabel() == "correct_frac"


def test_figures_skip_without_the_runs_they_need(
    runs: pd.DataFrame, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    only_full = runs[runs["policy"] == "full"]
    for name in FIGURE_NAMES:
        assert getattr(figures, name)(only_full, tmp_path) is None
        assert getattr(figures, name)(runs.iloc[0:0], tmp_path) is None
    no_rmm = runs[runs["policy"] != "rmm"]
    assert figures.ppl_vs_lag(no_rmm, tmp_path) is None
    assert figures.measure_vs_accumulate(no_rmm, tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out.count("[figures] skipping") == 2 * len(FIGURE_NAMES) + 2
    partial = figures.make_all(no_rmm, tmp_path)
    assert [name for name, fig in partial.items() if fig is not None] == [
        "ppl_vs_budget",
        "ratio_vs_budget",
        "cumulative_ppl",
        "throughput_memory",
    ]


@pytest.mark.slow  # redraws every figure through the CLI; the make_all fixture draws them in the fast loop
def test_figures_cli(runs_csv: Path, tmp_path: Path) -> None:
    assert figures.main([str(runs_csv), "--out", str(tmp_path)]) == 0
    for name in FIGURE_NAMES:
        assert_saved(tmp_path, name)


def test_committed_notebook_has_no_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and "RESULTS_CSV" in code[0].source and "RMM_RESULTS_CSV" in code[0].source
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow  # starts a Jupyter kernel
def test_notebook_runs_on_synthetic_results(
    runs_csv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nbclient import NotebookClient

    monkeypatch.setenv("RMM_RESULTS_CSV", str(runs_csv))
    monkeypatch.setenv("RMM_FIGURES_DIR", str(tmp_path / "figures"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == len(FIGURE_NAMES)
    markdown = "".join(o["data"].get("text/markdown", "") for o in outputs if "data" in o)
    assert "| policy | B=64 | B=128 |" in markdown and "| full | 18.00 [" in markdown
    assert "### baseline `policy=h2o`" in markdown  # the comparison table
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "delta_nll" in printed and "ppl ratio" in printed  # two runs compared
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"{N_RUNS} complete runs" in printed
    for name in FIGURE_NAMES:
        assert_saved(tmp_path / "figures", name)


def test_legends_outside_the_axes(drawn: tuple[dict, Path]) -> None:
    assert set(drawn[0]) == set(FIGURE_NAMES)
    for name, fig in drawn[0].items():
        renderer = fig.canvas.get_renderer()
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), name


def test_figures_draw_the_intervals(runs: pd.DataFrame, drawn: tuple[dict, Path]) -> None:
    fig = drawn[0]["ppl_vs_budget"]
    bars = np.concatenate([np.asarray(c.get_segments()) for c in fig.axes[0].collections])  # (n, 2, 2)
    h2o = runs[runs["policy"] == "h2o"].sort_values("budget")
    for low, high in zip(h2o["ppl_ci_low"], h2o["ppl_ci_high"], strict=True):
        assert any(np.allclose(seg[:, 1], [low, high]) for seg in bars)
    lag = drawn[0]["ppl_vs_lag"]  # one h2o run at the budget: bands paired against it
    assert "paired against h2o" in lag.axes[0].get_title() and len(lag.axes[0].collections) == 2


def test_notebook_writes_outside_the_repository_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RMM_FIGURES_DIR", raising=False)
    first = next(cell for cell in nbformat.read(NOTEBOOK, as_version=4).cells if cell.cell_type == "code")
    namespace: dict[str, object] = {}
    exec(first.source, namespace)  # the cell that chooses where figures go
    figures_dir = Path(str(namespace["FIGURES_DIR"])).resolve()
    assert figures_dir.is_dir() and NOTEBOOK.parents[1] not in figures_dir.parents
    figures_dir.rmdir()


def test_one_policy_table_covers_every_policy_and_weight() -> None:
    """Every registered policy gets a colour of its own (from the table, or a spare one by its name) and a
    label; the table names no policy that is not registered; every weight has a colour; no two policies
    (and no two weights) share a colour."""
    from matplotlib import colors as mcolors

    from rmm.analysis.policy_table import (
        POLICY_TABLE,
        SPARE_COLORS,
        WEIGHT_COLORS,
        policy_color,
        policy_label,
    )
    from rmm.policies import POLICIES, oracle, rmm

    assert set(POLICY_TABLE) <= set(POLICIES)
    assert set(WEIGHT_COLORS) == set(rmm.WEIGHTS) | set(oracle.WEIGHTS)
    policy_rgb = [mcolors.to_rgb(policy_color(name)) for name in POLICIES]
    assert len(set(policy_rgb)) == len(policy_rgb)
    tabled = {mcolors.to_rgb(style.color) for style in POLICY_TABLE.values()}
    assert not tabled & {mcolors.to_rgb(c) for c in SPARE_COLORS}
    assert policy_label("a_new_policy") == "a_new_policy" and policy_color("a_new_policy") in SPARE_COLORS
    assert len({mcolors.to_rgb(c) for c in WEIGHT_COLORS.values()}) == len(WEIGHT_COLORS)


def test_ratio_vs_budget_draws_the_paired_ratios(runs: pd.DataFrame, drawn: tuple[dict, Path]) -> None:
    """Each line is a label's paired ratio to h2o (rmm/analysis/compare.py), by budget; h2o itself is the
    dashed line at 1, not a line of its own."""
    from rmm.analysis.compare import compare_sweep

    ax = drawn[0]["ratio_vs_budget"].axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    assert "h2o" not in lines and lines["baseline (policy=h2o)"].get_ydata()[0] == 1.0
    comparisons = compare_sweep(runs[runs["policy"].isin(["streaming_llm", "h2o"])])
    expected = comparisons.sort_values("budget")
    line = lines[expected["label"].iloc[0]]
    assert line.get_xdata().tolist() == expected["budget"].tolist()
    assert line.get_ydata() == pytest.approx(expected["ppl_ratio"].to_numpy())
