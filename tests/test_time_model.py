"""The time model (checks/time_model.py) and the planner's --time, --calibrate and sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_model

from checks import plan as planner
from checks import time_model
from checks.time_model import GPUS, ModelShape, StreamShape
from rmm.engine import StreamingEngine
from rmm.policies import make_policy

LLAMA3_8B = ["model=llama3_8b", "dataset.max_tokens=8192", "dataset.n_docs=8", "chunk=64", "budget=1024"]


@pytest.mark.parametrize(
    ("policy_cfg", "budget", "chunk", "n_tokens"),
    [
        ({"name": "window"}, 16, 8, 100),  # a position rule: a first pass of B, then 1024-token passes
        ({"name": "window"}, 16, 8, 2100),
        ({"name": "full"}, None, 8, 2100),
        ({"name": "h2o"}, 16, 4, 50),
        ({"name": "h2o"}, 16, 16, 49),
        ({"name": "rmm", "lag": 4}, 16, 4, 3),
    ],
)
def test_schedule_is_the_engines(policy_cfg, budget, chunk, n_tokens):
    """The passes the time model counts are the engine's own (rmm.engine.StreamingEngine.chunks)."""
    policy = make_policy(policy_cfg, budget, chunk)
    engine = StreamingEngine(tiny_model("llama"), policy)
    passes = [stop - start for start, stop in engine.chunks(n_tokens, engine.plan.recording)]
    stream = planner.stream_shape(engine.plan.recording, n_tokens, policy.budget)
    assert time_model.schedule(n_tokens, stream.first, stream.step) == passes
    assert stream.retained + min(stream.step, n_tokens) == sum(engine.plan.recording.slots(n_tokens))


def test_matmul_parameters_are_the_models():
    """The analytic weight count (projections, gated MLP, LM head) plus the input embedding is the
    model's parameter count, less the norms."""
    for name, tied in (("llama3_8b", False), ("qwen2_5_7b", False), ("smollm2_135m", True)):
        arch = planner.model_architecture(planner.compose_config([f"model={name}"]).model)
        shape = ModelShape.from_architecture(arch)
        embedding = 0 if tied else shape.vocab * shape.hidden
        count = planner.parameter_count(arch)
        assert 0 <= count - (shape.matmul_params + embedding) < 0.002 * count, name


def test_pass_work_follows_the_stated_formulas():
    model = ModelShape(n_layers=2, hidden=8, intermediate=16, n_heads=4, n_kv_heads=2, head_dim=2, vocab=10)
    stream = StreamShape(n_tokens=100, retained=12, first=4, step=4)
    work = time_model.pass_work(model, stream, rows=3, queries=4, element=2, boundary=False)
    slots, tokens = 12 + 4, 3 * 4
    params = 2 * (8 * (4 + 4) * 2 + 4 * 2 * 8 + 3 * 8 * 16) + 8 * 10
    assert model.matmul_params == params
    assert work.flops == 2 * params * tokens + 4 * 2 * 4 * 2 * 4 * slots * 3
    ops = time_model.OP_COUNTS["position"]  # a position rule: one shared mask per layer
    assert work.launches == ops.fixed + ops.per_layer * 2 + 2 * ops.per_stream  # the batch's pass, 3 rows
    kv = 3 * 2 * 2 * slots * 2 * 2 * 2  # rows x L x H x S x head_dim x (K, V) x bf16
    activations = 2 * tokens * 2 * (4 * 8 + (4 + 4) * 2 + 3 * 16) * 2
    masks = 3 * 2 * 4 * slots  # a shared [Q, S] mask read per layer and stream
    assert work.bytes == params * 2 + kv + activations + tokens * 10 * (2 + 8) + masks
    boundary = time_model.pass_work(model, stream, rows=3, queries=4, element=2, boundary=True)
    assert boundary.launches == work.launches + ops.boundary and boundary.bytes > work.bytes


@pytest.mark.parametrize(
    ("policy", "family"),
    [
        ("full", "position"),
        ("window", "position"),
        ("random", "score"),
        ("h2o", "observed"),
        ("rmm", "observed"),
    ],
)
def test_launches_per_pass_are_the_op_counts_whatever_the_batch(policy, family):
    """Ops per pass: a + b L for the policy's family, plus d at a boundary and e per stream beyond the first
    (one memory for the batch attends once per layer and decides once per pass; each policy scores its own
    stream); times the cost per launch."""
    cfg = planner.compose_config([*LLAMA3_8B, f"policy={policy}"])
    model, _, _, spec = planner.time_works(cfg)
    stream = planner.stream_shape(spec.recording, spec.n_tokens, spec.budget)
    assert stream.family == family
    ops = time_model.OP_COUNTS[family]
    for boundary in (False, True):
        for rows in (1, 4, 16):
            launches = time_model.pass_work(model, stream, rows, 64, 2, boundary).launches
            extra = ops.per_stream * (rows - 1)
            assert launches == ops.fixed + ops.per_layer * 32 + (ops.boundary if boundary else 0) + extra
    work = time_model.pass_work(model, stream, 4, 64, 2, True)
    with_host, without = (
        time_model.seconds([work], time_model.with_constants(GPUS["h200"], {"launch_s": s}))
        for s in (time_model.LAUNCH_S, 0.0)
    )
    assert with_host - without == pytest.approx(work.launches * 5e-6)
    plain = time_model.OP_COUNTS["plain"]
    assert plain.launches(32, False) == 2762 and ops.launches(32, True, 16) <= 1.6 * plain.launches(32, False)


def test_gpu_time_is_the_roofline_plus_overhead():
    """A named GPU, per group of passes: max(FLOPs / (peak x u_f), bytes / (bandwidth x u_b)) + units x o."""
    h200 = GPUS["h200"]
    assert h200.flops == 989e12 * time_model.MATMUL_UTILISATION
    assert h200.bytes_per_s == 4.8e12 * time_model.BANDWIDTH_UTILISATION
    model, works, reference, spec = planner.time_works(planner.compose_config([*LLAMA3_8B, "policy=h2o"]))
    assert reference == [] and spec.batch == 4
    result = planner.run_time(planner.compose_config([*LLAMA3_8B, "policy=h2o"]), h200)
    expected = time_model.predict(time_model.totals(works), h200.as_vector())
    assert result.wall_s == pytest.approx(expected)
    assert result.passes == 2 * (1 + (8192 - 64) // 64)  # two waves of 4 documents, 128 passes each
    a100 = planner.run_time(planner.compose_config([*LLAMA3_8B, "policy=h2o"]), GPUS["a100"])
    assert a100.wall_s > result.wall_s


def test_batch_and_reference_pass():
    """A larger batch shares the passes' weights and overhead; the oracle adds its reference pass, run
    ``batch`` documents side by side."""
    one, four = (
        planner.run_time(planner.compose_config([*LLAMA3_8B, "policy=oracle", f"batch={n}"]), GPUS["h200"])
        for n in (1, 4)
    )
    assert four.stream_s < one.stream_s and one.reference_s > 0
    assert four.reference_s < one.reference_s
    h2o = planner.run_time(planner.compose_config([*LLAMA3_8B, "policy=h2o", "batch=4"]), GPUS["h200"])
    assert h2o.reference_s == 0


def test_sweep_jobs_follow_hydras_basic_sweeper():
    main_table = planner.compose_config(["experiment=main_table"], hydra=True).hydra.sweeper.params
    n_policies, n_budgets = (len(str(main_table[key]).split(",")) for key in ("policy", "budget"))
    assert len(planner.sweep_jobs(["experiment=main_table"])) == n_policies * n_budgets
    jobs = planner.sweep_jobs(["experiment=main_table", "policy=h2o,rmm"])  # the command line wins
    policies = {override for job in jobs for override in job if override.startswith("policy=")}
    assert len(jobs) == 2 * n_budgets and policies == {"policy=h2o", "policy=rmm"}
    assert planner.sweep_jobs(["policy=h2o,rmm", "budget=64,128", "chunk=32"]) == [
        ["policy=h2o", "budget=64", "chunk=32"],
        ["policy=h2o", "budget=128", "chunk=32"],
        ["policy=rmm", "budget=64", "chunk=32"],
        ["policy=rmm", "budget=128", "chunk=32"],
    ]
    assert planner.sweep_jobs(["budget=64"]) == [["budget=64"]]


def test_a_sweep_counts_what_its_runs_share_once():
    """full at its second budget and the oracle's reference passes at its second budget are what the
    runner reuses (rmm.sharing): counted once; reuse=false counts them again. The total comes with its
    range at half and twice the cost per launch."""
    report = planner.time_report([*LLAMA3_8B, "policy=full,oracle,h2o", "budget=512,1024"], GPUS["h200"])
    runs = {
        tuple(o for o in run["overrides"] if o.startswith(("policy=", "budget="))): run
        for run in report["runs"]
    }
    full, again = runs["budget=512", "policy=full"], runs["budget=1024", "policy=full"]
    assert full["wall_s"] > 0 and again["wall_s"] == again["passes"] == 0 and "reuses" in again["notes"][0]
    oracle, other = runs["budget=512", "policy=oracle"], runs["budget=1024", "policy=oracle"]
    assert oracle["reference_s"] > 0 and other["reference_s"] == other["reference_passes"] == 0
    assert other["stream_s"] > 0 and all(
        run["wall_s"] > 0 for (p, _), run in runs.items() if p == "policy=h2o"
    )
    unshared = planner.time_report(
        [*LLAMA3_8B, "policy=full,oracle,h2o", "budget=512,1024", "reuse=false"], GPUS["h200"]
    )
    assert unshared["total_wall_s"] == pytest.approx(
        report["total_wall_s"] + full["wall_s"] + oracle["reference_s"]
    )
    low, high = report["total_device_hours_range"]
    for hours, factor in ((low, 0.5), (high, 2.0)):
        slower = time_model.with_constants(GPUS["h200"], {"launch_s": time_model.LAUNCH_S * factor})
        shifted = planner.time_report([*LLAMA3_8B, "policy=full,oracle,h2o", "budget=512,1024"], slower)
        assert hours == pytest.approx(shifted["total_device_hours"])
    assert low < report["total_device_hours"] < high


def test_cli_time_of_a_sweep(capsys: pytest.CaptureFixture[str]):
    planner.main([*LLAMA3_8B, "policy=h2o,window,oracle", "--time", "--gpu", "h100", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["name"] == "H100 SXM"
    assert [run["overrides"][-1] for run in out["runs"]] == ["policy=h2o", "policy=window", "policy=oracle"]
    assert out["total_wall_s"] == pytest.approx(sum(run["wall_s"] for run in out["runs"]))
    planner.main([*LLAMA3_8B, "policy=rmm", "lag=2000", "--time"])  # lag >= B - C + 1: refused
    assert "runs the configs refuse (not counted): 1" in capsys.readouterr().out


def test_bench_points_as_bench_writes_them():
    """checks/bench.py's labels: ``window@C`` with ``pass_tokens`` (a position rule in C-token
    passes), and the weight in ``run`` (``rmm[gradient]/original``) where ``policy`` drops it."""
    base = {"model": "smollm2_135m", "positions": "original", "budget": 256, "chunk": 64, "batch": 1}
    base |= {"n_docs": 2, "tokens_per_doc": 1024, "threads": 2, "records_attention": False}
    window = dict(base, policy="window", run="window/original", pass_tokens=1024)
    window_at_c = dict(base, policy="window@C", run="window@C/original", pass_tokens=64)
    passes = [
        sum(w.passes for w in planner.time_works(planner.compose_config(planner.point_overrides(p)), 2, q)[1])
        for p, q in ((window, 1024), (window_at_c, 64))
    ]
    assert passes == [2 * 2, 2 * 16]  # a first pass of B = 256, then 768 tokens / 1024-token passes
    assert planner.point_works(window_at_c)[:, 2].sum() > planner.point_works(window)[:, 2].sum()
    rmm = dict(base, policy="rmm", run="rmm/original", records_attention=True)
    gradient = dict(rmm, run="rmm[gradient]/original")
    assert "policy.weight=gradient" in planner.point_overrides(gradient)
    assert planner.point_works(gradient)[:, 0].sum() > 1.9 * planner.point_works(rmm)[:, 0].sum()


# ---- calibration on synthetic points: the fit recovers the constants that made them ------------------
TRUE = np.array([2.0e10, 8.0e9, 1.0e-5])  # CPU-like: effective FLOP/s, bytes/s, seconds per launch


def synthetic_points() -> list[dict]:
    """Bench-like points on SmolLM2-135M (fp32): compute-bound, bandwidth-bound and overhead-heavy
    passes (chunk 1 to 256, batch 1 and 4), wall times from the model with :data:`TRUE`."""
    grid = [
        ("window", "original", 256, 64, 1),
        ("streaming_llm", "cache", 256, 64, 4),
        ("h2o", "original", 256, 64, 1),
        ("h2o", "original", 256, 64, 4),
        ("h2o", "original", 256, 8, 1),
        ("rmm", "original", 256, 1, 1),
        ("tova", "original", 128, 16, 4),
        ("knorm", "original", 256, 256, 1),
        ("full", "original", None, 64, 1),
        ("plain_forward", "original", None, 2048, 1),
    ]
    points = []
    for policy, positions, budget, chunk, batch in grid:
        point = {
            "model": "smollm2_135m",
            "policy": policy,
            "positions": positions,
            "budget": budget,
            "chunk": chunk,
            "batch": batch,
            "n_docs": 4,
            "tokens_per_doc": 4096 if chunk > 1 else 512,
            "threads": 2,
        }
        wall = time_model.predict(planner.point_works(point), TRUE)
        point |= {"wall_s": wall, "tokens_per_s": point["n_docs"] * point["tokens_per_doc"] / wall}
        point["records_attention"] = policy in ("h2o", "rmm", "tova")
        points.append(point)
    return points


def test_calibration_recovers_known_constants(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    points = synthetic_points()
    path, out, constants = tmp_path / "points.json", tmp_path / "calibration.md", tmp_path / "cpu.json"
    path.write_text(json.dumps(points))
    planner.main(["--calibrate", str(path), "--out", str(out), "--constants-out", str(constants)])
    fitted = json.loads(constants.read_text())
    assert len(fitted) == 1 and fitted[0]["threads"] == 2
    got = np.array([fitted[0][key] for key in time_model.CONSTANT_NAMES])
    np.testing.assert_allclose(got, TRUE, rtol=1e-4)
    table = out.read_text()
    assert table == capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| smollm2_135m")]
    assert len(rows) == len(points) >= 5
    assert "largest relative error: 0.0%" in table and "not identified" not in table
    # the fitted constants predict with the same formula as a GPU's
    hardware = planner.hardware_named(str(constants))
    cfg = planner.compose_config(planner.point_overrides(points[3]))
    assert planner.run_time(cfg, hardware).wall_s == pytest.approx(points[3]["wall_s"], rel=1e-3)


def test_calibration_with_noise_and_unidentified_bandwidth(tmp_path: Path):
    """5 % noise: constants within 20 %; only compute-bound points: the bandwidth is said to be unpinned;
    a point the config contradicts (records_attention) is skipped and listed."""
    rng = np.random.default_rng(0)
    points = synthetic_points()
    for point in points:
        point["wall_s"] *= float(np.exp(rng.normal(0, 0.05)))
    fit = time_model.fit([planner.point_works(p) for p in points], [p["wall_s"] for p in points])
    np.testing.assert_allclose(fit.constants, TRUE, rtol=0.2)
    assert fit.max_relative_error < 0.2 and all(fit.identified.values())
    compute = [p for p in synthetic_points() if p["chunk"] >= 64 and p["policy"] != "full"]
    fit = time_model.fit([planner.point_works(p) for p in compute], [p["wall_s"] for p in compute])
    assert not fit.identified["bytes_per_s"] and fit.identified["flops"]
    bad = dict(compute[0], records_attention=True)  # window records no attention
    report, _ = planner.calibrate([*compute, bad], "test")
    assert "## Skipped points" in report and "records_attention=True" in report
    assert "not identified: no point is bandwidth-bound" in report
