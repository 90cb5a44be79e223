"""Every config composes; every experiment preset sweeps only valid, distinctly named runs."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import submitit
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import get_class
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import DictConfig, OmegaConf

from rmm.data import STREAM_MODES
from rmm.options import POSITIONS, SCOPES
from rmm.policies import POLICIES, make_policy

CONF = Path(__file__).resolve().parents[1] / "conf"
STUDIES = ("main_table", "lag_sweep", "weight_ablation", "positions_ablation", "chunk_ablation")
GPU_SCALES = ("pg19", "proof_pile")  # conf/scale/: a study at GPU scale is experiment=<study> scale=<name>
GPU_MODELS = ("llama2_7b", "llama3_8b", "mistral_7b", "qwen2_5_7b")
PRESETS = [f"{study}{suffix}" for study in STUDIES for suffix in ("", "_cpu")]
RUN_KEYS = ["policy", "budget", "chunk", "lag", "positions", "scope", "seed"]  # what makes a run valid

Compose = Callable[..., DictConfig]


def options(group: str) -> list[str]:
    """Option names of a config group, nested ones as ``sub/name``; ``experiment`` is every study's presets
    (``studies/<study>/experiment/``, on Hydra's search path)."""
    roots = (
        sorted((CONF.parent / "studies").glob("*/experiment")) if group == "experiment" else [CONF / group]
    )
    names = [str(p.relative_to(root).with_suffix("")) for root in roots for p in root.rglob("*.yaml")]
    assert len(names) == len(set(names)), f"two studies define the same {group} preset"
    return sorted(names)


def sweep_jobs(params: Mapping[str, Any]) -> list[list[str]]:
    """The jobs (override lists) Hydra's basic sweeper makes of ``hydra.sweeper.params``."""
    parsed = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
    axes = []
    for override in parsed:
        values = override.sweep_string_iterator() if override.is_sweep_override() else None
        values = list(values) if values is not None else [override.get_value_element_as_str()]
        axes.append([f"{override.get_key_element()}={value}" for value in values])
    return [list(job) for job in itertools.product(*axes)]


# Every top-level preset (at a GPU scale a study sweeps the same runs: test_study_presets).
SWEEPS = [name for name in options("experiment") if "/" not in name]


@pytest.fixture(scope="module")
def compose_cfg() -> Iterator[Compose]:
    """Hydra's compose, memoized per override list: the tests compose the same presets again and again
    (about 80 ms each). The configs are read-only, so no test can change what another one composes."""
    composed: dict[tuple[tuple[str, ...], bool], DictConfig] = {}

    def compose_once(*overrides: str, hydra: bool = False) -> DictConfig:
        if (overrides, hydra) not in composed:
            cfg = compose("config", overrides=list(overrides), return_hydra_config=hydra)
            OmegaConf.set_readonly(cfg, True)
            composed[overrides, hydra] = cfg
        return composed[overrides, hydra]

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield compose_once


def check_run_config(cfg: DictConfig) -> None:
    """The invariants the runner relies on: it resolves, and its policy accepts budget, chunk and lag."""
    run_keys = [key for key in cfg if key != "hydra"]
    OmegaConf.to_container(OmegaConf.masked_copy(cfg, run_keys), resolve=True, throw_on_missing=True)
    assert cfg.policy.name in POLICIES
    assert cfg.positions in POSITIONS and cfg.scope in SCOPES
    make_policy(cfg.policy, budget=cfg.budget, chunk=cfg.chunk)


def test_config_groups_are_complete() -> None:
    assert set(options("policy")) == set(POLICIES)
    assert set(PRESETS) <= set(options("experiment"))
    assert {"slurm", "local"} <= set(options("hydra/launcher"))


@pytest.mark.parametrize("model", options("model"))
def test_model_configs(compose_cfg: Compose, model: str) -> None:
    extra = ["model.path=/models/mine"] if model == "local" else []
    cfg = compose_cfg(f"model={model}", *extra)
    check_run_config(cfg)
    assert cfg.model.name == model
    assert cfg.model.source in ("gguf_package", "hub", "local")


@pytest.mark.parametrize("dataset", options("dataset"))
def test_dataset_configs(compose_cfg: Compose, dataset: str) -> None:
    cfg = compose_cfg(f"dataset={dataset}")
    check_run_config(cfg)
    assert cfg.dataset.name == dataset and cfg.dataset.stream in STREAM_MODES


@pytest.mark.parametrize("policy", options("policy"))
def test_policy_configs(compose_cfg: Compose, policy: str) -> None:
    cfg = compose_cfg(f"policy={policy}")
    check_run_config(cfg)
    assert cfg.policy.name == policy


@pytest.mark.parametrize("scale", options("scale"))
def test_every_scale_composes_with_a_study(compose_cfg: Compose, scale: str) -> None:
    check_run_config(compose_cfg(f"scale={scale}"))
    check_run_config(compose_cfg("experiment=weight_ablation", f"scale={scale}", hydra=True))


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_config_composes(compose_cfg: Compose, experiment: str) -> None:
    """Presets compose on their own; a lag arm is composed into lag_sweep, at its budget."""
    group, _, arm = experiment.rpartition("/")
    if group == "lag_arm":
        overrides = ["experiment=lag_sweep", f"experiment/lag_arm@_global_={arm}"]
    else:
        overrides = [f"experiment={experiment}"]
    check_run_config(compose_cfg(*overrides, hydra=True))


@pytest.mark.slow  # composes every job of every preset
@pytest.mark.parametrize("experiment", SWEEPS)
def test_sweep_runs_are_valid_and_distinct(compose_cfg: Compose, experiment: str) -> None:
    """Every job of the sweep is a valid run, and no two jobs share a run directory."""
    base = compose_cfg(f"experiment={experiment}", hydra=True)
    jobs = sweep_jobs(base.hydra.sweeper.params or {})  # no params: a single run
    run_dirs = set()
    for job in jobs:
        cfg = compose_cfg(f"experiment={experiment}", *job, hydra=True)
        check_run_config(cfg)
        run_dirs.add(f"{cfg.hydra.sweep.dir}/{cfg.hydra.sweep.subdir}")
        if experiment.endswith("_cpu"):
            assert (cfg.model.name, cfg.dataset.name, cfg.device) == ("smollm2_135m", "shakespeare", "cpu")
            assert cfg.dataset.n_docs <= 2 and cfg.dataset.max_tokens <= 512
            assert cfg.budget <= 128 and cfg.wandb.mode in ("disabled", "offline")
    assert len(run_dirs) == len(jobs), f"{experiment}: runs share a directory"


@pytest.mark.parametrize("study", STUDIES)
def test_study_presets(compose_cfg: Compose, study: str) -> None:
    """A study sweeps into multirun/<preset>; at a GPU scale it sweeps the same runs on a 7-8B model."""
    base = compose_cfg(f"experiment={study}", hydra=True)
    assert len(sweep_jobs(base.hydra.sweeper.params)) > 1
    for suffix in ("", "_cpu"):
        cfg = compose_cfg(f"experiment={study}{suffix}", hydra=True)
        assert cfg.hydra.sweep.dir == f"multirun/{study}{suffix}"
    for scale in GPU_SCALES:
        cfg = compose_cfg(f"experiment={study}", f"scale={scale}", hydra=True)
        assert cfg.hydra.sweep.dir == f"multirun/{study}"
        assert cfg.hydra.sweeper.params == base.hydra.sweeper.params
        assert OmegaConf.masked_copy(cfg, RUN_KEYS) == OmegaConf.masked_copy(base, RUN_KEYS)
        assert cfg.model.name in GPU_MODELS and cfg.dataset.name == scale
        assert cfg.dtype == "bfloat16" and cfg.dataset.max_tokens == 32768


def test_lag_sweep_runs_each_reference_once(compose_cfg: Compose) -> None:
    cfg = compose_cfg("experiment=lag_sweep", hydra=True)
    policies = [
        compose_cfg("experiment=lag_sweep", *job).policy.name for job in sweep_jobs(cfg.hydra.sweeper.params)
    ]
    assert policies.count("h2o") == policies.count("oracle") == 1
    assert policies.count("rmm") == 7


def test_slurm_launcher(compose_cfg: Compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SLURM launcher's parameters, converted as the plugin does, make a valid sbatch script."""
    monkeypatch.setenv("SBATCH_ACCOUNT", "env_account")
    cfg = compose_cfg(
        "hydra/launcher=slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.timeout_min=90",
        f"hydra.sweep.dir={tmp_path}",
        hydra=True,
    )
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert get_class(params.pop("_target_")).__name__ == "SlurmLauncher"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")  # submitit only checks that srun exists
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"), prepend=os.pathsep)
    executor = submitit.AutoExecutor(
        cluster="slurm",
        folder=params.pop("submitit_folder"),
        slurm_max_num_timeout=params.pop("max_num_timeout"),
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    sbatch = executor._executor._make_submission_file_text("python run.py", "uid")
    for line in ("--partition=gpu", "--account=env_account", "--gpus-per-node=1", "--time=90", "--mem=64GB"):
        assert f"#SBATCH {line}\n" in sbatch
    assert str(tmp_path / ".submitit") in sbatch


def test_local_launcher(compose_cfg: Compose, tmp_path: Path) -> None:
    cfg = compose_cfg("hydra/launcher=local", f"hydra.sweep.dir={tmp_path}", hydra=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert get_class(params.pop("_target_")).__name__ == "LocalLauncher"
    executor = submitit.AutoExecutor(cluster="local", folder=params.pop("submitit_folder"))
    executor.update_parameters(**params)
    assert executor._executor.parameters["gpus_per_node"] == 1


def test_lag_is_defined_once_and_overridable_at_top_level(compose_cfg: Compose) -> None:
    """`python run.py policy=rmm lag=64`: the top-level `lag` is the only default, rmm.yaml forwards it."""
    cfg = compose_cfg("policy=rmm", "lag=64")
    assert cfg.policy.lag == 64 and make_policy(cfg.policy, budget=cfg.budget, chunk=cfg.chunk).lag == 64
    assert compose_cfg("policy=rmm").policy.lag == compose_cfg().lag
    with pytest.raises(ValueError, match="missing 1 required positional argument: 'lag'"):
        make_policy({"name": "rmm"}, budget=256, chunk=64)


def test_lag_auto_passes_the_config_checks(compose_cfg: Compose) -> None:
    """`python run.py policy=rmm lag=auto`: accepted by the checks, its run name carries the step, and a
    fixed lag's run name is what it was before the step existed."""
    from rmm.config import check_run

    cfg = compose_cfg("policy=rmm", "lag=auto")
    check_run(cfg)
    assert make_policy(cfg.policy, budget=cfg.budget, chunk=cfg.chunk).lags == [32, 48, 64, 96]
    assert "/rmm_Hauto_correct_accumulate_step16_B256_C64_" in cfg.run_name
    assert "/rmm_H64_correct_accumulate_B256_C64_" in compose_cfg("policy=rmm", "lag=64").run_name
    with pytest.raises(ValueError, match="integer >= 0 or auto"):
        check_run(compose_cfg("policy=rmm", "lag=sometimes"))


def test_layers_enter_the_run_name_only_when_not_all(compose_cfg: Compose) -> None:
    """Run directories written before the layers axis keep their names; layers=global carries _Lglobal."""
    from rmm.config import check_run

    every = compose_cfg("policy=h2o").run_name
    assert every == compose_cfg("policy=h2o", "layers=all").run_name
    assert compose_cfg("policy=h2o", "layers=global").run_name == every.replace("_s0", "_Lglobal_s0")
    check_run(compose_cfg("policy=h2o", "layers=global"))
    with pytest.raises(ValueError, match="layers must be one of"):
        check_run(compose_cfg("policy=h2o", "layers=sliding"))
    with pytest.raises(ValueError, match="allocation=uniform"):
        check_run(compose_cfg("policy=h2o", "layers=global", "allocation=pyramid"))


def test_allocation_enters_the_run_name_only_when_not_uniform(compose_cfg: Compose) -> None:
    """Run directories written before the allocation axis keep their names; the others carry _A<name>."""
    from rmm.config import check_run

    uniform = compose_cfg("policy=h2o").run_name
    assert uniform == compose_cfg("policy=h2o", "allocation=uniform").run_name
    assert "_A" not in uniform
    for allocation in ("adaptive", "pyramid"):
        name = compose_cfg("policy=h2o", f"allocation={allocation}").run_name
        assert name == uniform.replace("_original_s0", f"_original_A{allocation}_s0")
        check_run(compose_cfg("policy=h2o", f"allocation={allocation}"))
    for overrides, fix in [
        (("allocation=adaptive", "scope=layer"), "scope=head"),
        (("allocation=pyramid", "scope=global"), "scope=head|layer"),
        (("allocation=pyramid", "positions=cache"), "positions=original"),
    ]:
        with pytest.raises(ValueError, match=re.escape(fix)):
            check_run(compose_cfg("policy=h2o", *overrides))
    with pytest.raises(ValueError, match="allocation=uniform"):
        check_run(compose_cfg("policy=window", "allocation=pyramid"))
    with pytest.raises(ValueError, match="allocation must be one of"):
        check_run(compose_cfg("policy=h2o", "allocation=pyramids"))


COMMITTED = {"reproduce_cpu_": "results/cpu/runs", "reuse_cpu_": "results/cpu/reuse/runs"}


def covering(jobs: list[list[str]]) -> list[list[str]]:
    """The jobs, in order, that add a value of a swept parameter not seen before: together they use every
    value of every parameter (12 of reproduce_cpu_baselines' 48 jobs: each policy and each budget)."""
    seen: set[str] = set()
    out = []
    for job in jobs:
        if not seen.issuperset(job):
            out.append(job)
            seen.update(job)
    return out


@pytest.mark.parametrize(
    "every_job", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["covering", "all"]
)
@pytest.mark.parametrize("prefix", sorted(COMMITTED))
def test_committed_runs_resume_under_the_current_configs(
    compose_cfg: Compose, prefix: str, every_job: bool
) -> None:
    """Every committed run is a job of its study's presets whose stored config the current code accepts as
    unchanged, so `make reproduce-cpu` / `make reproduce-reuse` skip it instead of refusing or recomputing.

    The fast loop composes the jobs that cover every value of every swept parameter (70 of 121 jobs: a
    changed default, policy config or run name shows there); the slow suite composes every job and checks
    that every committed run is one of them."""
    from rmm.runner import changed_keys
    from rmm.storage import read_config, run_is_complete

    root = CONF.parent / COMMITTED[prefix]
    committed = {p.parent for p in root.glob("*/*/*/metrics.json") if run_is_complete(p.parent)}
    matched = set()
    for preset in [name for name in SWEEPS if name.startswith(prefix)]:
        base = compose_cfg(f"experiment={preset}", hydra=True)
        jobs = sweep_jobs(base.hydra.sweeper.params or {})
        for job in jobs if every_job else covering(jobs):
            cfg = compose_cfg(f"experiment={preset}", *job, hydra=True)
            run_dir = CONF.parent / cfg.hydra.sweep.dir / cfg.run_name
            if run_dir not in committed:
                continue
            current = OmegaConf.to_container(
                OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True
            )
            assert changed_keys(read_config(run_dir), current) == [], run_dir
            matched.add(run_dir)
    assert committed and matched
    if every_job:
        assert matched == committed, sorted(committed - matched)[:3]


def test_repeated_kv_heads_enter_the_run_name(compose_cfg: Compose) -> None:
    """+model.repeat_kv=true (rmm/kv_heads.py) holds G times the entries: its runs never resume another's."""
    plain = compose_cfg("policy=h2o").run_name
    assert compose_cfg("policy=h2o", "+model.repeat_kv=false").run_name == plain
    repeated = compose_cfg("policy=h2o", "+model.repeat_kv=true").run_name
    assert repeated == plain.replace("smollm2_135m/", "smollm2_135m_repeat_kv/", 1) != plain
