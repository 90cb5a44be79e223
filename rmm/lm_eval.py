"""lm-evaluation-harness front end: the model type ``rmm``, a causal LM streamed under a bounded KV memory.

    python -m rmm.lm_eval --model rmm --tasks wikitext \\
        --model_args pretrained=smollm2_135m,policy=h2o,budget=256,chunk=64

``python -m rmm.lm_eval`` is lm-eval's own command line with the ``rmm`` model registered (lm-eval 0.4 has
no plugin hook through which the plain ``lm_eval`` command could find it); from Python,
``import rmm.lm_eval`` then ``lm_eval.simple_evaluate(model="rmm", model_args=...)``. docs/lm_eval.md.

Every request is ONE stream through :class:`rmm.engine.StreamingEngine` (no disjoint windows):
``loglikelihood_rolling`` sums the log-probabilities of all the document's tokens, conditioned on the
prefix token as lm-eval's ``hf`` model does, so wikitext-style word and byte perplexities are measured
under eviction; ``loglikelihood`` streams context + continuation and scores the continuation. Tokens are
encoded exactly as lm-eval's ``hf`` model (HFLM) encodes them, so with ``policy=full`` both models agree
to float32 rounding (tests/test_lm_eval.py) on every request that HFLM scores in one window: a rolling
document of at most ``max_length`` tokens, and a ``loglikelihood`` request within ``max_length`` (HFLM
cuts a longer one to the model's context; here it streams whole unless ``max_length`` is given).
Generation is not supported.

This module imports lm_eval at the top; ``import rmm`` never imports it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from rmm.api import reference_pass, run_engine
from rmm.data import Document
from rmm.engine import StreamingEngine
from rmm.model_config import describe_model
from rmm.models import load_model, model_config, resolve_device, resolve_dtype
from rmm.options import StreamOptions
from rmm.policies import make_policy

log = logging.getLogger(__name__)

# lm-eval's own arguments to every model (simple_evaluate's additional config): accepted, not used (an
# integer ``batch_size`` sets the engine's batch)
_LM_EVAL_KEYS = ("batch_size", "max_batch_size")
DEFAULT_BATCH = 4  # streams per forward pass when lm-eval gives no integer batch_size
GENERATION_REFUSED = (
    "the rmm model scores tokens under a bounded KV memory (loglikelihood, loglikelihood_rolling and "
    "multiple_choice tasks); it does not generate. Run generation tasks with `--model hf`."
)


@register_model("rmm")
class RmmLM(TemplateLM):
    """lm-eval's ``LM`` over :class:`rmm.engine.StreamingEngine`.

    Parameters (lm-eval's ``--model_args``)
    ----------
    pretrained : a model shipped with the harness (``smollm2_135m``, any ``conf/model/*.yaml`` name), a
        local ``save_pretrained`` directory, a Hugging Face hub id, or a loaded ``PreTrainedModel``
        (then ``tokenizer`` is required).
    tokenizer : a tokenizer or its path (default: the model's own).
    revision : the hub revision of a hub id.
    policy, budget, chunk, positions, scope, allocation, layers, oracle_tau, oracle_context : as
        :func:`rmm.evaluate`; any other key is a parameter of the policy (``lag=32``, ``weight=prob``).
    device, dtype : ``auto`` (CUDA + bf16 when present, else CPU + fp32), ``cpu``, ``cuda:N``; ``float32``,
        ``bfloat16``. A CUDA device that this machine lacks falls back to the CPU (lm-eval's CLI passes
        ``cuda:0`` by default), as lm-eval's ``hf`` model does.
    batch_size : lm-eval's ``--batch_size`` (its command line passes 1 unless told): an integer N streams N
        requests side by side in one forward pass (a request's scores do not depend on it beyond fp32
        rounding); ``auto`` or none: 4.
    max_length : None (default): streams are never cut. An integer N: a ``loglikelihood`` request keeps
        its last N + 1 tokens, as HFLM truncates (rolling documents always stream whole).
    add_bos_token, prefix_token_id : as HFLM's (tokenization and the prefix of rolling documents and of
        empty contexts: the tokenizer's BOS, else its EOS).
    """

    def __init__(
        self,
        pretrained: Any = "smollm2_135m",
        tokenizer: Any = None,
        revision: str | None = None,
        policy: str = "full",
        budget: int | None = None,
        chunk: int = 64,
        positions: str = "original",
        scope: str = "head",
        allocation: str = "uniform",
        layers: str = "all",
        oracle_tau: float = 0.02,
        oracle_context: int | None = None,
        device: str | None = "auto",
        dtype: str | None = "auto",
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        **policy_params: Any,
    ) -> None:
        super().__init__()
        batch_size = str(policy_params.get("batch_size", ""))
        batch = int(batch_size) if batch_size.isdigit() else DEFAULT_BATCH
        for key in _LM_EVAL_KEYS:
            policy_params.pop(key, None)
        budget = None if isinstance(budget, str) and budget.lower() in ("none", "null") else budget
        options = StreamOptions(positions, scope, allocation, layers, batch)  # checked before the model loads
        self.model, self.tokenizer, self.model_context = _load(
            pretrained, tokenizer, revision, _device(device), dtype, add_bos_token
        )
        self._device = next(self.model.parameters()).device
        self.policy = make_policy({"name": policy, **policy_params}, budget=budget, chunk=int(chunk))
        self.engine = StreamingEngine(self.model, self.policy, options)
        self.oracle_tau, self.oracle_context = float(oracle_tau), oracle_context
        self._max_length = None if max_length is None else int(max_length)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.settings = {
            "policy": policy,
            "budget": budget,
            "chunk": int(chunk),
            **options.as_dict(),
            **policy_params,
        }
        self.streamed_tokens = 0

    # --- tokens, as lm-eval's HFLM ---------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """HFLM's: the given ``prefix_token_id``, else the tokenizer's BOS, else its EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or self.model_context

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kw
    ) -> list[int]:
        """HFLM's ``tok_encode``: the tokenizer's special tokens unless told (``add_bos_token``), and none
        when the string already starts with the prefix token's text."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # --- requests ----------------------------------------------------------------------------------

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Per document: the summed log-probability of all its tokens, [prefix] + tokens in one stream."""
        sequences = [[self.prefix_token_id, *self.tok_encode(req.args[0])] for req in requests]
        streamed = self._stream([s for s in sequences if len(s) > 1], disable_tqdm)
        results = []
        for request, sequence in zip(requests, sequences, strict=True):
            total = -float(next(streamed)[0].sum()) if len(sequence) > 1 else 0.0  # HFLM: 0 for no tokens
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            results.append(total)
        return results

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kw
    ) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, whether greedy decoding produces all of it)."""
        sequences = []
        for strings, context, continuation in requests:
            if not continuation or len(continuation) > self.max_length:  # HFLM asserts both
                raise ValueError(
                    f"request {strings!r}: its continuation encodes to {len(continuation)} tokens; lm-eval's "
                    f"hf model scores 1 to max_length = {self.max_length} of them (the context takes the "
                    "continuation's first characters when they merge into one token)"
                )
            sequence = context + continuation
            if self._max_length is not None:
                sequence = sequence[-(self._max_length + 1) :]
            sequences.append(sequence)
        results = []
        streamed = self._stream(sequences, disable_tqdm)
        for strings, _, continuation in requests:
            nll, correct = next(streamed)
            n = len(continuation)
            answer = (-float(nll[-n:].sum()), bool(correct[-n:].all()))
            self.cache_hook.add_partial("loglikelihood", strings, answer)
            results.append(answer)
        return results

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(GENERATION_REFUSED)

    def _stream(self, sequences: list[list[int]], disable_tqdm: bool = False):
        """Yield (nll [n - 1], correct [n - 1]) of each sequence, each one stream from an empty memory,
        ``batch`` streams side by side per forward pass, through the run's one setup
        (:func:`rmm.api.run_engine`: the self-check on the longest sequence before the first scored token,
        then the stream) with the oracles' reference pass (:func:`rmm.api.reference_pass`)."""
        if not sequences:
            return
        tokens = [torch.tensor(sequence, dtype=torch.long) for sequence in sequences]
        longest = max(t.numel() for t in tokens)
        if longest < 2:
            raise ValueError("every request needs 2 tokens or more to score a prediction")
        reference = reference_pass(
            self.model, self.policy, longest, self.oracle_tau, self.oracle_context, self.model_context
        )
        progress = tqdm(total=len(tokens), disable=disable_tqdm or len(tokens) < 2, desc="rmm streams")
        docs = [Document(f"request-{i}", ids, {}) for i, ids in enumerate(tokens)]
        _, frame = run_engine(
            self.engine, docs, reference, on_chunk=lambda totals, doc: _counter(progress, doc)
        )
        progress.close()
        frames = dict(list(frame.groupby("doc_id", sort=False)))
        for doc in docs:
            rows = frames[doc.doc_id].iloc[1:]  # row p: x_p predicted by query p - 1 (p = 0: none)
            self.streamed_tokens += doc.tokens.numel()
            yield rows["nll"].to_numpy(dtype="float64"), rows["correct"].to_numpy(dtype=bool)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval writes into its results' ``config``: the memory's settings and the self-check."""
        return {
            "rmm": {
                k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                for k, v in self.settings.items()
            },
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.engine.facts.dtype).removeprefix("torch."),
            "rmm_streamed_tokens": self.streamed_tokens,
            **self.engine.self_check_metrics(),
        }


def _device(name: str | None) -> torch.device:
    """:func:`rmm.models.resolve_device`, except that a CUDA device on a machine without one falls back
    to the CPU, as lm-eval's ``hf`` model does (lm-eval's CLI asks for ``cuda:0`` unless told)."""
    name = "auto" if name in (None, "") else str(name)
    if name.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device=%s was requested but CUDA is not available: running on the CPU", name)
        name = "cpu"
    return resolve_device(name)


def _load(
    pretrained: Any,
    tokenizer: Any,
    revision: str | None,
    device: torch.device,
    dtype: str | None,
    add_bos_token: bool | None = None,
):
    """(model, tokenizer, the model's context) from a harness model name, a directory, a hub id or a
    loaded model. A tokenizer loaded here adds its BOS or not as ``add_bos_token`` says (None: its own
    setting), as HFLM loads its tokenizer with it; a tokenizer handed over is used as it is."""
    bos = {} if add_bos_token is None else {"add_bos_token": bool(add_bos_token)}
    torch_dtype = resolve_dtype(dtype or "auto", device)
    max_context = None
    if not isinstance(pretrained, str):
        if tokenizer is None or isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            source = tokenizer or pretrained.config.name_or_path
            tokenizer = AutoTokenizer.from_pretrained(source, **bos)
        model = pretrained
    else:
        cfg = model_config(pretrained, revision)
        max_context = cfg.get("max_context")
        model, own = load_model(cfg, device, torch_dtype)
        if tokenizer is None:
            tokenizer = own
            if add_bos_token is not None:  # as from_pretrained(..., add_bos_token=) sets it
                tokenizer.add_bos_token = bool(add_bos_token)
        elif isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer, **bos)
    return model, tokenizer, int(max_context or describe_model(model)["max_position_embeddings"])


def _counter(progress: tqdm, doc: Document):
    """A per-chunk hook that advances ``progress`` by one when ``doc``'s last chunk has streamed."""
    n = doc.tokens.numel()
    return lambda streamed, nll: progress.update(1) if streamed == n else None


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line (``lm_eval ...``) with the ``rmm`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":  # python -m rmm.lm_eval: this module (as __main__) registered the model above
    main()
