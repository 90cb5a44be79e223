"""The library API (rmm.evaluate, rmm.compare): the README's example runs, it is the runner's path, and
``import rmm`` stays light."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SENTENCES, assert_agree, tiny_model, tiny_tokenizer

import rmm
from rmm.divergence import Trace
from rmm.engine import StreamingEngine
from rmm.policies import make_policy
from rmm.storage import read_metrics, read_tokens, run_is_complete

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A saved tiny Llama with its tokenizer, loadable by ``from_pretrained``."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def readme_example() -> str:
    """The python block under the README's "Python API" heading."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs(saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = readme_example()
    assert len(code.strip().splitlines()) <= 12
    code = re.sub(r"^MODEL = .*$", f'MODEL = "{saved}"', code, flags=re.M)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    h2o, ours = namespace["h2o"], namespace["ours"]
    assert h2o.ppl > 1 and ours.ppl > 1 and h2o.ppl != ours.ppl
    assert run_is_complete(tmp_path / "runs" / "my_rmm")


@pytest.mark.slow  # converts the shipped GGUF on a fresh machine (seconds once cached)
def test_load_model_loads_the_shipped_model_offline() -> None:
    model, tokenizer = rmm.load_model("smollm2_135m", device="cpu")
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert tokenizer("Shall I").input_ids


def test_evaluate_matches_the_engine_and_saves_a_run(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer))
    texts = [" ".join(SENTENCES * 3), " ".join(reversed(SENTENCES * 2))]
    result = rmm.evaluate(model, texts, tokenizer=tokenizer, policy="rmm", budget=12, chunk=4, lag=3)
    assert model.config._attn_implementation != "rmm_bounded"  # restored
    policy = make_policy({"name": "rmm", "lag": 3}, budget=12, chunk=4)
    for i, text in enumerate(texts):  # evaluate batches the documents: equal to the stated bound (conftest)
        direct = StreamingEngine(model, policy).stream(torch.tensor(tokenizer(text).input_ids))
        got = Trace.of_frame(result.tokens[result.tokens["doc_id"] == f"doc-{i:04d}"])
        assert_agree(got, Trace.of(direct), f"evaluate's doc {i} against a direct stream")
    assert result.metrics["n_docs"] == 2 and result.metrics["policy"] == "rmm" and result.metrics["lag"] == 3
    run_dir = result.save(tmp_path / "run")
    assert read_metrics(run_dir)["ppl"] == result.ppl
    assert len(read_tokens(run_dir)) == len(result.tokens)
    full = rmm.evaluate(model, token_ids=[tokenizer(t).input_ids for t in texts], policy="full")
    paired = rmm.compare(full, result)
    assert paired["n_tokens"] == result.metrics["n_tokens"] and paired["ppl_ratio"] == pytest.approx(
        result.ppl / full.ppl, rel=1e-4
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"texts": ["a b c"]}, "texts need a tokenizer"),
        ({}, "pass exactly one of"),
        ({"token_ids": [[1]]}, "2 tokens or more"),
        ({"token_ids": [[1, 2, 3]], "policy": "rmm", "budget": 8, "chunk": 4}, "lag"),
        ({"token_ids": [[1, 2, 3]], "budget": 8, "chunk": 4}, "budget=8 without a policy"),
        ({"token_ids": [[1, 2, 3]], "policy": "h2o", "chunk": 4}, "policy h2o needs a budget"),
        ({"token_ids": [[1, 2, 3]], "policy": "h2o", "budget": 8.5, "chunk": 4}, "budget must be an integer"),
        ({"token_ids": [[1, 2, 3]], "policy": "h2o", "budget": 8, "chunk": "4"}, "chunk must be an integer"),
        (
            {"token_ids": [[1, 2, 3]], "policy": "h2o", "budget": 8, "rho": "half"},
            "policy.rho must be a number",
        ),
        ({"token_ids": [[1, 10**6, 3]], "policy": "full"}, "doc-0000 has token id 1000000, outside"),
        ({"token_ids": [[1, -1, 3]], "policy": "full"}, "doc-0000 has token id -1, outside"),
    ],
)
def test_bad_api_input_is_explained(kwargs: dict, message: str) -> None:
    model = tiny_model("llama")
    texts = kwargs.pop("texts", None)
    with pytest.raises(ValueError, match=message):
        rmm.evaluate(model, texts, **kwargs)


def test_import_rmm_is_light() -> None:
    """``import rmm`` and the config checks import neither torch nor transformers."""
    code = (
        "import sys, rmm, rmm.config; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow  # SmolLM2 through run.py in a subprocess, and in this process through rmm.evaluate
def test_evaluate_equals_run_py_on_smollm2(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from rmm.data import load_documents
    from rmm.models import load_model

    overrides = [
        "dataset.n_docs=2",
        "dataset.max_tokens=160",
        "policy=rmm",
        "lag=16",
        "budget=64",
        "chunk=16",
        "positions=cache",
        "wandb.mode=disabled",
        "progress=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    subprocess.run(
        [sys.executable, "run.py", *overrides], cwd=ROOT, check=True, capture_output=True, timeout=600
    )
    model, tokenizer = load_model(
        OmegaConf.load(ROOT / "conf/model/smollm2_135m.yaml"), torch.device("cpu"), torch.float32
    )
    data = OmegaConf.merge(
        OmegaConf.load(ROOT / "conf/dataset/shakespeare.yaml"), {"n_docs": 2, "max_tokens": 160}
    )
    docs, _ = load_documents(data, tokenizer)
    ours = rmm.evaluate(model, documents=docs, policy="rmm", lag=16, budget=64, chunk=16, positions="cache")
    stored = read_tokens(tmp_path / "run")
    assert stored[["doc_id", "position", "token_id"]].equals(ours.tokens[["doc_id", "position", "token_id"]])
    expected = stored["nll"].dropna().to_numpy()
    got = ours.tokens["nll"].dropna().to_numpy()
    assert abs(expected - got).max() <= 1e-6
    assert read_metrics(tmp_path / "run")["ppl"] == pytest.approx(ours.ppl, rel=1e-6)
