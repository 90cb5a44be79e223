"""lm-evaluation-harness front end (rmm/lm_eval.py): the ``rmm`` model type, end to end through
``lm_eval.simple_evaluate`` on local task files (no hub), against lm-eval's own ``hf`` model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SENTENCES, record_max, tiny_model, tiny_tokenizer

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import rmm.lm_eval  # noqa: E402,F401  (registers the model type "rmm")

ROOT = Path(__file__).resolve().parents[1]
PPL, MC = "rmm_test_ppl", "rmm_test_mc"
# fp32: the engine's chunked attention and the model's own attention round differently (docs/testing.md),
# and HFLM sums a request's log-probabilities in float32 (one ulp at 1000 is 6e-5): |ours - hf| <= ABSOLUTE +
# RELATIVE * |hf| for every summed log-probability
ABSOLUTE, RELATIVE = 5e-5, 1e-6


def write_tasks(root: Path, docs: list[str], questions: list[dict]) -> Path:
    """A perplexity task (loglikelihood_rolling, wikitext's metrics) and a multiple-choice task over
    local jsonl files: ``dataset_path: json`` with ``data_files``, loaded offline by ``datasets``."""
    (root / "ppl.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    cache = f"  cache_dir: {root / 'datasets_cache'}\n"  # datasets' cache stays in the temporary folder
    (root / "ppl.yaml").write_text(
        f"task: {PPL}\n{common}dataset_kwargs:\n{cache}  data_files:\n    test: {root / 'ppl.jsonl'}\n"
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    (root / "mc.yaml").write_text(
        f"task: {MC}\n{common}dataset_kwargs:\n{cache}  data_files:\n    test: {root / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n'
    )
    return root


def run(model, model_args, tasks_dir: Path) -> dict:
    """simple_evaluate on both tasks: {task: [per-document responses]} plus the results' config."""
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[PPL, MC],
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    samples = {
        task: [s["filtered_resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]
        for task in (PPL, MC)
    }
    return {"samples": samples, "results": out["results"], "config": out["config"]}


def loglikelihoods(result: dict) -> list[float]:
    """Every returned log-probability, documents then choices, in a fixed order."""
    rolling = [float(r[0] if isinstance(r, list) else r) for r in result["samples"][PPL]]
    choices = [float(pair[0]) for doc in result["samples"][MC] for pair in doc]
    return rolling + choices


def greedy(result: dict) -> list[bool]:
    return [bool(pair[1]) for doc in result["samples"][MC] for pair in doc]


def compare(ours: dict, theirs: dict, name: str) -> None:
    a, b = loglikelihoods(ours), loglikelihoods(theirs)
    assert len(a) == len(b) and all(math.isfinite(x) and x <= 0 for x in a)
    record_max(f"{name}, absolute", max(abs(x - y) for x, y in zip(a, b, strict=True)))
    record_max(f"{name}, relative", max(abs(x - y) / max(abs(y), 1.0) for x, y in zip(a, b, strict=True)))
    assert all(abs(x - y) <= ABSOLUTE + RELATIVE * abs(y) for x, y in zip(a, b, strict=True)), (a, b)
    assert greedy(ours) == greedy(theirs)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"][PPL][metric] == pytest.approx(theirs["results"][PPL][metric], rel=1e-5)
    assert ours["results"][MC]["acc,none"] == theirs["results"][MC]["acc,none"]


# --- a tiny random Llama saved to a directory (fast) ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_tasks(tmp_path_factory) -> Path:
    docs = [" ".join(SENTENCES * 2), " ".join(reversed(SENTENCES)), ""]  # "" scores 0, as in HFLM
    questions = [
        {
            "question": "shall i compare thee",
            "choices": [" to a summer's day", " art more lovely"],
            "label": 0,
        },
        {"question": "rough winds do shake", "choices": [" the darling buds", " of may", " and"], "label": 1},
        {"question": "", "choices": ["thou art", "and summer's"], "label": 0},  # empty context: the prefix
    ]
    return write_tasks(tmp_path_factory.mktemp("tasks"), docs, questions)


def test_full_equals_lm_evals_hf_model_on_a_tiny_llama(tiny_dir: Path, tiny_tasks: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert tokenizer.bos_token_id is None  # the prefix is EOS here; SmolLM2's test covers a BOS
    hf = run(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), None, tiny_tasks)
    ours = run("rmm", f"pretrained={tiny_dir},policy=full,chunk=4,device=cpu", tiny_tasks)
    compare(ours, hf, "lm_eval rmm full vs hf (tiny llama), summed logprob")
    assert ours["samples"][PPL][2] in (0.0, [0.0])
    config = ours["config"]
    assert config["rmm"]["policy"] == "full" and config["self_check_max_dnll"] is not None


def test_a_bounded_policy_changes_the_result(tiny_dir: Path, tiny_tasks: Path) -> None:
    full = run("rmm", {"pretrained": str(tiny_dir), "policy": "full", "chunk": 4}, tiny_tasks)
    args = {"pretrained": str(tiny_dir), "policy": "rmm", "budget": 6, "chunk": 2, "lag": 2}
    bounded = run("rmm", args, tiny_tasks)
    a, b = loglikelihoods(full), loglikelihoods(bounded)
    assert all(math.isfinite(x) for x in b)
    assert a[0] != b[0]  # the 60-token document outgrows the 6-entry memory
    oracle = run(
        "rmm", {"pretrained": str(tiny_dir), "policy": "oracle", "budget": 6, "chunk": 2}, tiny_tasks
    )
    c = loglikelihoods(oracle)  # the oracles' reference pass runs
    assert all(math.isfinite(x) for x in c) and c[0] != a[0] and c[0] != b[0]
    assert bounded["config"]["rmm"] == {
        "policy": "rmm",
        "budget": 6,
        "chunk": 2,
        "positions": "original",
        "scope": "head",
        "allocation": "uniform",
        "layers": "all",
        "batch": 4,
        "lag": 2,
    }


def test_generation_is_refused_and_bad_policy_parameters_are_explained(tiny_dir: Path) -> None:
    lm = rmm.lm_eval.RmmLM(pretrained=str(tiny_dir), policy="h2o", budget=8, chunk=4, batch_size=1)
    with pytest.raises(NotImplementedError, match="--model hf"):
        lm.generate_until([])
    with pytest.raises(ValueError, match="bad parameters for policy 'h2o'"):
        rmm.lm_eval.RmmLM(pretrained=str(tiny_dir), policy="h2o", budget=8, no_such_parameter=1)


def test_tokens_and_refusals_as_hflms(tiny_dir: Path, tmp_path: Path) -> None:
    """add_bos_token reaches a tokenizer loaded from a path as HFLM's reaches its own (the tiny tokenizer's
    BOS is its EOS text), and a request HFLM refuses (an empty continuation, one longer than max_length) is
    refused rather than scored."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.bos_token = tokenizer.eos_token
    tokenizer.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    text = "shall i compare thee"
    for add_bos in (None, True, False):
        ours = rmm.lm_eval.RmmLM(pretrained=str(tmp_path), device="cpu", add_bos_token=add_bos)
        theirs = HFLM(pretrained=str(tmp_path), device="cpu", add_bos_token=add_bos)
        assert ours.tok_encode(text) == theirs.tok_encode(text), add_bos
        assert (ours.tok_encode(text)[0] == tokenizer.bos_token_id) is bool(add_bos)
    lm = rmm.lm_eval.RmmLM(pretrained=str(tiny_dir), device="cpu", max_length=4)
    with pytest.raises(ValueError, match="encodes to 0 tokens"):
        lm._loglikelihood_tokens([(("shall i", ""), [5, 6], [])])
    with pytest.raises(
        ValueError, match="encodes to 5 tokens; lm-eval's hf model scores 1 to max_length = 4"
    ):
        lm._loglikelihood_tokens([(("shall", " i compare thee to"), [5], [6, 7, 8, 9, 10])])


@pytest.mark.slow  # a fresh interpreter; lm-eval's command line indexes its thousands of task files (14 s)
def test_the_command_line(tiny_dir: Path, tiny_tasks: Path, tmp_path: Path) -> None:
    """``python -m rmm.lm_eval`` is lm-eval's command line with the rmm model registered, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = f"pretrained={tiny_dir},policy=h2o,budget=8,chunk=4"
    command = [sys.executable, "-m", "rmm.lm_eval", "--model", "rmm", "--model_args", args]
    command += ["--tasks", PPL, "--include_path", str(tiny_tasks), "--output_path", str(tmp_path / "out")]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    stored = json.loads(results.read_text())
    assert math.isfinite(stored["results"][PPL]["word_perplexity,none"])
    assert stored["config"]["rmm"]["policy"] == "h2o" and stored["config"]["rmm"]["budget"] == 8


# --- the embedded SmolLM2 (slow) --------------------------------------------------------------------


@pytest.mark.slow  # SmolLM2-135M on the CPU: lm-eval's hf model, and rmm under full and a bounded policy
def test_smollm2_full_equals_hf_and_a_window_differs(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from rmm.models import load_model

    docs = [
        "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: rough winds "
        "do shake the darling buds of May, and summer's lease hath all too short a date.",
        "When in disgrace with fortune and men's eyes, I all alone beweep my outcast state, and trouble "
        "deaf heaven with my bootless cries, and look upon myself and curse my fate.",
    ]
    questions = [
        {"question": "The capital of France is", "choices": [" Paris", " London", " Rome"], "label": 0},
        {"question": "Two plus two equals", "choices": [" four", " five"], "label": 0},
    ]
    tasks = write_tasks(tmp_path, docs, questions)
    cfg = OmegaConf.load(ROOT / "conf/model/smollm2_135m.yaml")
    model, tokenizer = load_model(cfg, torch.device("cpu"), torch.float32)
    assert tokenizer.bos_token_id is not None
    hf = run(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), None, tasks)
    common = {"pretrained": model, "tokenizer": tokenizer, "chunk": 16}  # the loaded model: no second load
    full = run("rmm", {**common, "policy": "full"}, tasks)
    compare(full, hf, "lm_eval rmm full vs hf (SmolLM2), summed logprob")
    window = run("rmm", {**common, "policy": "window", "budget": 16}, tasks)
    a, b = loglikelihoods(full), loglikelihoods(window)
    assert all(math.isfinite(x) for x in b) and a[:2] != b[:2]
    # the shipped-name path loads the same checkpoint
    named = rmm.lm_eval.RmmLM(pretrained="smollm2_135m", device="cpu", dtype="float32")
    assert named.model_context == cfg.max_context and named.prefix_token_id == tokenizer.bos_token_id
