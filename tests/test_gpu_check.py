"""checks/gpu_check.py end to end on the CPU (--small), and its dependency promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_proxies import BF16_TOKEN_NLL_ATOL, DECIDING_SAME_SETS, EXACT_SETS, KEY_RANKING_MEAN_NLL_ATOL

from checks import gpu_check, plan
from rmm.policies import POLICIES

ROOT = Path(__file__).resolve().parents[1]


def test_small_check_runs_end_to_end(tmp_path: Path):
    out = tmp_path / "gpu" / "check.json"
    summary = gpu_check.main(["--device", "cpu", "--small", "--threads", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary))
    sections = summary["sections"]
    assert not [name for name, section in sections.items() if "error" in section], sections
    fp32, bf16 = sections["matrix"]["float32"], sections["matrix"]["bfloat16"]
    assert fp32["agrees"] and fp32["disagreeing"] == []
    assert fp32["identical_sets_frac"] == 1.0 and fp32["max_token_nll_diff"] <= gpu_check.FP32_NLL_ATOL
    assert set(bf16["identical_sets_frac_by_policy"]) == set(POLICIES)
    assert 0.0 <= bf16["identical_sets_frac"] <= 1.0
    # bf16 on every policy in the fast loop (test_proxies.py's 48-token matrices run in the slow suite):
    # the same tolerances, on this matrix's 24-token Llama stream
    assert bf16["max_token_nll_diff_while_sets_identical"] <= BF16_TOKEN_NLL_ATOL, bf16
    assert bf16["max_mean_nll_diff"] <= KEY_RANKING_MEAN_NLL_ATOL, bf16
    same = bf16["identical_sets_frac_by_policy"]
    assert all(same[name] == 1.0 for name in EXACT_SETS), same
    assert all(fraction >= DECIDING_SAME_SETS for fraction in same.values()), same
    speed = sections["speed"]
    for key in ("window/original", "streaming_llm/cache", "h2o/original", "rmm/original"):
        assert speed["tokens_per_s"][key] > 0
        assert key in speed["peak_memory_bytes"][str(speed["tokens"])]
    assert {"plain_forward_128", "equal_work", "token_loop_64"} <= set(speed["tokens_per_s"])
    assert "h2o/original / equal_work" in speed["ratios"]
    points = sections["points"]["speed_points"]
    assert plan.load_points(out) == points  # --calibrate reads the check's JSON as it is
    assert [(p["policy"], p["batch"]) for p in points] == [
        *((name, batch) for name, _, _, batch in gpu_check.POINT_POLICIES),
        ("plain_forward", 1),
    ]
    for point in points:  # the format checks/plan.py --calibrate reads
        assert set(plan.POINT_KEYS) <= set(point) and point["wall_s"] > 0 and point["tokens_per_s"] > 0
        assert point["model"] == "llama3_1_8b_small_test"  # not a shipped config: calibration skips them
        full_size = dict(point, model="llama3_1_8b")  # the GPU's points: the time model describes them
        assert plan.point_works(full_size).shape[1] == 3
    kernels = sections["kernels"]
    _, _, batches, _ = gpu_check.KERNEL_SIZES[True]
    runs = kernels["runs"]
    assert [row["batch"] for row in runs] == [b for b in batches for _ in gpu_check.KERNEL_RUNS]
    for row in runs:
        assert row["launches_are"].startswith("dispatched ops")  # the CPU's fallback, and it says so
        assert 0 < row["launches_per_pass"] == row["ops_less_views_per_pass"] < row["ops_per_pass"]
        assert row["wall_s_per_pass"] > 0 and row["busy_s_per_pass"] > 0 and row["model"]["flops"] > 0
        assert 0.75 < row["ops_per_pass"] / row["model"]["launches"] < 1.33  # the time model's op counts
        assert row["attention_kernels"] and row["top_kernels"]
        if row["run"].startswith(("h2o", "rmm")):  # attention recorded: the explicit path's softmax
            assert any("softmax" in kernel["name"] for kernel in row["attention_kernels"]), row
    calibration = kernels["calibration"]
    hardware = plan.hardware_named(str(out))  # checks/plan.py --time --gpu reads the check's JSON as it is
    assert hardware.launch_s == calibration["launch_s"] >= 0
    assert (
        hardware.flops == calibration["flops"] > 0 and hardware.bytes_per_s == calibration["bytes_per_s"] > 0
    )


IMPORT_CHECK = (
    "import sys; sys.modules.update(scipy=None, psutil=None); import checks.gpu_check; "
    "print(sorted({m.split('.')[0] for m in sys.modules} & "
    "{'hydra', 'omegaconf', 'wandb', 'datasets', 'gguf', 'submitit'}))"
)


@pytest.mark.background([sys.executable, "-c", IMPORT_CHECK], cwd=ROOT)  # a fresh interpreter: about 5 s
def test_needs_only_its_promised_dependencies(background: subprocess.CompletedProcess):
    """Importing the check pulls in none of Hydra, OmegaConf, W&B, datasets or gguf, and needs neither scipy
    nor psutil (here made unimportable)."""
    assert background.returncode == 0, background.stderr
    assert background.stdout.strip() == "[]"
