"""The architecture matrix: every causal LM type transformers registers, streamed tiny and checked.

The types come from transformers' own registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), not from a hand
list, so a new model type gets a row without a code change. Each type is built small and random from
its own default config (:func:`tiny_config`: generic rules keyed on config attributes, no per-type
overrides) and classified by :func:`classify`:

* ``exact``: ``full``, ``window`` with B >= n and a multi-chunk ``h2o`` with B >= n give the model's own
  per-token NLL (its forward pass, default attention) within :data:`TOLERANCE`; ``window`` (B = 12) and
  ``h2o`` (B = 12, C = 4) match :func:`rmm.reference.reference_stream` in both position modes (``h2o``
  with one set per layer, ``scope=layer``, under multi-head latent attention, whose heads share entries).
* ``exact (no reference)``: as ``exact``, but the reference cannot run this architecture (it raised).
* ``refused``: the harness raised :class:`~rmm.errors.UnsupportedModelError` (for some case; the rest
  were exact).
* ``skipped``: the type cannot be built small (or its check timed out).
* ``WRONG``: a mismatch without a refusal, the worst outcome; ``CRASH``: any other exception.

``python -m checks.architectures [--types a,b] [--out docs/models.md] [--update]`` prints the table (and
writes it between the matrix markers of docs/models.md; with ``--update`` only the rows of ``--types``
change there, the others are kept as the file has them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from rmm.api import evaluate
from rmm.engine import StreamingEngine
from rmm.errors import UnsupportedModelError
from rmm.files import atomic_write_text
from rmm.model_config import latent_attention
from rmm.policies import make_policy
from rmm.reference import ReferenceSpec, reference_stream

# the common size fields, by their standard names (a config's attribute_map renames them)
SIZES: dict[str, int] = {
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 512,
}
WINDOW = 16  # sliding windows and attention chunks: the 96-token streams outgrow them
N_TOKENS = 96
BUDGET, CHUNK = 12, 4  # the bounded cases checked against the reference (below the tiny windows of 16)
FULL_CHUNK = 16  # the multi-chunk h2o with B >= n
TOLERANCE = 1e-4  # max |dNLL| per token
INITIALIZER_RANGE = 0.1  # peaked attention, so that eviction changes the NLL
TIMEOUT_S = 120
MAX_PERIOD = 8  # the most layers a tiny model takes to keep its default's layer-type pattern
STATUSES = ("exact", "exact (no reference)", "refused", "skipped", "WRONG", "CRASH")
PASSING = ("exact", "exact (no reference)", "refused", "skipped")


@dataclass
class Row:
    """One model type's outcome. ``max_dnll``: the largest |dNLL| measured (None if nothing ran)."""

    model_type: str
    status: str
    reason: str
    max_dnll: float | None = None


class NotBuildable(Exception):
    """The model type cannot be built small (its row is ``skipped``)."""


# ---- the types and their tiny configs -----------------------------------------------------------
def causal_lm_types() -> list[str]:
    """Every decoder-only type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config class builds."""
    types = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = _quiet(AutoConfig.for_model, model_type)
        except Exception:
            continue
        if getattr(config, "is_encoder_decoder", False):
            continue
        types.append(model_type)
    return types


def tiny_config(model_type: str) -> PretrainedConfig:
    """``model_type``'s default config shrunk to :data:`SIZES` (every sub-config too), raising
    :class:`NotBuildable` when it cannot be. Only the arguments that change are passed (the config's own
    ``__post_init__`` derives the rest), by generic rules keyed on config attributes, never on the type:

    * the size fields, by the config's own names (``attribute_map``); a multi-head default stays
      multi-head (KV heads = heads); other ``hidden_size*``, ``*vocab*`` and ``*intermediate_size``
      fields capped like the main ones; latent ranks and head dims to 16 (latent attention's query
      split 8 + 8, its values 8 wide), rotary dims scaled with the head dim (partial rotary kept);
    * mixture of experts: 4 experts, 2 per token, one group;
    * per-layer lists (``layer_types``, NoPE flags, ...) and per-layer mappings (``per_layer_config``)
      rebuilt for 4 layers, keeping every kind the default has (cycled in order of appearance), a
      per-layer size scaled like the global one; layer counts (``num_kv_shared_layers``) scaled;
    * ``sliding_window`` and ``attention_chunk_size`` to :data:`WINDOW`; ``is_decoder`` on;
      ``initializer_range`` :data:`INITIALIZER_RANGE`; a ``pad_token_id`` outside the vocabulary to
      its last id (other special ids stay outside it, :func:`stream_tokens` avoids those inside).
    """
    try:
        default = _quiet(AutoConfig.for_model, model_type)
    except Exception as err:
        raise NotBuildable(f"its config does not build: {_short(err)}") from err
    if getattr(default, "is_encoder_decoder", False):
        raise NotBuildable("encoder-decoder")
    try:
        return _shrink(default)
    except Exception as err:
        raise NotBuildable(f"no small config: {_short(err)}") from err


def _shrink(config: PretrainedConfig) -> PretrainedConfig:
    return _quiet(type(config), **_overrides(config))


def _overrides(config: PretrainedConfig) -> dict[str, Any]:
    """The init arguments that shrink ``config``: only what changes; the config's own ``__post_init__``
    derives the rest (head dims, layer patterns) from them. Sub-configs are shrunk the same way."""
    cls = type(config)
    names = _init_fields(config)
    aliases = getattr(config, "attribute_map", {}) or {}
    out: dict[str, Any] = {}
    for key in names:
        value = _get(config, key)
        if isinstance(value, PretrainedConfig):
            out[key] = {**({"model_type": value.model_type} if value.model_type else {}), **_overrides(value)}
    size_keys = set()
    for name, value in SIZES.items():
        key = aliases.get(name, name)
        if key in names and not isinstance(getattr(cls, key, None), property):
            out[key] = value
            size_keys.add(key)
    heads, kv = (aliases.get(n, n) for n in ("num_attention_heads", "num_key_value_heads"))
    if kv in out and _get(config, kv) in (None, _get(config, heads)):
        out[kv] = SIZES["num_attention_heads"]  # multi-head by default: stays multi-head
    n_default = _get(config, "num_hidden_layers")
    n_heads, hidden = _get(config, "num_attention_heads"), _get(config, "hidden_size")
    head_dim = _get(config, "head_dim") or (hidden // n_heads if hidden and n_heads else None)
    n_layers = SIZES["num_hidden_layers"]
    period = _period(config)
    if period is not None:  # per-layer shapes: one period of the default's layer types, in its order
        n_layers = out[aliases.get("num_hidden_layers", "num_hidden_layers")] = period
    raw = config.to_dict()
    # init fields, and the per-layer mappings that configs take as keywords (``per_layer_config``)
    per_layer_keys = {k for k, v in raw.items() if "layer" in k and isinstance(v, dict) and k not in names}
    for key in sorted((names - size_keys) | per_layer_keys):
        value = _get(config, key)
        # the field's own name and the standard names that map to it
        lower = " ".join([key, *(alias for alias, target in aliases.items() if target == key)]).lower()
        if isinstance(value, bool):
            if key == "is_decoder":
                out[key] = True
        elif "expert" in lower and (isinstance(value, int) or value is None):
            if any(word in lower for word in ("per_tok", "top_k", "topk")):
                out[key] = 2 if value is None else min(value, 2)
            elif "shared" in lower and "size" not in lower:
                continue
            elif any(word in lower for word in ("size", "hidden", "dim")):
                out[key] = (
                    SIZES["intermediate_size"] if value is None else min(value, SIZES["intermediate_size"])
                )
            elif any(word in lower for word in ("num", "n_")) or lower.endswith("experts"):
                out[key] = 4 if value is None else min(value, 4)
        elif isinstance(value, int):
            if key in ("n_group", "topk_group", "num_expert_group"):
                out[key] = 1
            elif "intermediate_size" in lower:
                out[key] = min(value, SIZES["intermediate_size"])
            elif key.startswith("hidden_size"):  # other hidden sizes (per-layer inputs, global patches)
                out[key] = min(value, SIZES["hidden_size"])
            elif "vocab" in lower:
                out[key] = min(value, SIZES["vocab_size"])
            elif ("rotary" in lower or "rope" in lower) and lower.endswith("dim") and head_dim:
                out[key] = max(2, 2 * round(value * SIZES["head_dim"] / head_dim / 2))  # partial rotary kept
            elif key.endswith(("_rank", "head_dim")) and value > SIZES["head_dim"]:
                out[key] = SIZES["head_dim"]
            elif key in ("sliding_window", "attention_chunk_size", "sliding_window_size"):
                out[key] = min(value, WINDOW)
            elif key.endswith("d_state") or key == "ssm_state_size":  # a state-space mixer's state
                out[key] = min(value, SIZES["head_dim"])
            elif key == "mamba_chunk_size":  # its scan's chunks: the streams span several
                out[key] = min(value, WINDOW)
            elif key == "attn_layer_period":  # one attention layer in every two (Jamba)
                out[key], out["attn_layer_offset"] = 2, 1
            elif "layers" in key and n_default and 0 < value <= n_default:
                out[key] = max(1, round(value * n_layers / n_default))
            elif key == "pad_token_id":
                vocab = out.get(aliases.get("vocab_size", "vocab_size"))
                if vocab is not None and not 0 <= value < vocab:
                    out[key] = vocab - 1
        elif isinstance(value, float) and key == "initializer_range":
            out[key] = INITIALIZER_RANGE
        elif (
            isinstance(value, (list, tuple))
            and n_default
            and n_default != n_layers
            and len(value) == n_default
        ):
            out[key] = list(value)[:n_layers] if period else _per_layer(list(value), n_layers)
        elif isinstance(raw.get(key), dict) and "layer" in key and n_default and raw[key]:
            value = raw[key]  # the plain mapping (the attribute may be a per-layer view)
            if all(_layer_index(k, n_default) for k in value):  # {layer index: setting}
                by_index = {int(k): v for k, v in value.items()}  # keys as written: 5, "5" or "05"
                per_layer = [by_index.get(i) for i in range(n_default)]
                per_layer = [_scaled_entries(v, config, out) for v in per_layer]
                per_layer = per_layer[:n_layers] if period else _per_layer(per_layer, n_layers)
                out[key] = {i: v for i, v in enumerate(per_layer) if v is not None}
    for key in ("attn_layer_indices", "full_attn_idxs"):  # hybrid: attention in every other layer
        if key in names:  # (Bamba's default has none, LFM2's attends in every layer)
            out[key] = list(range(1, n_layers, 2))
            out.pop("layer_types", None)  # derived from them
    kinds = set(out.get("layer_types") or [])
    if kinds == {"linear_attention"}:  # the same, where the default lists recurrent layers only (Granite 4)
        out["layer_types"] = ["linear_attention", "full_attention"] * (n_layers // 2)
    if {"qk_nope_head_dim", "qk_rope_head_dim"} <= names:  # latent attention: query = nope + rope parts
        out["qk_nope_head_dim"] = out["qk_rope_head_dim"] = SIZES["head_dim"] // 2
        if "v_head_dim" in names:  # values narrower than keys, as DeepSeek's (128 against 192)
            out["v_head_dim"] = SIZES["head_dim"] // 2
    return out


def _period(config: PretrainedConfig) -> int | None:
    """The period of a heterogeneous config's ``layer_types`` (layers of their own shapes: Gemma 4's five
    sliding layers, then a full one), when longer than the tiny models' layers and at most
    :data:`MAX_PERIOD`; None otherwise (the kinds are cycled instead)."""
    kinds = _get(config, "layer_types")
    if not getattr(config, "is_heterogeneous", False) or not kinds:
        return None
    period = next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return period if SIZES["num_hidden_layers"] < period <= MAX_PERIOD else None


def _scaled_entries(entry: Any, config: PretrainedConfig, out: dict[str, Any]) -> Any:
    """A per-layer override (``{"head_dim": 512}``) with each size that the global config also has scaled
    like the global one (so that a layer twice as wide as the default stays twice as wide)."""
    if not isinstance(entry, dict):
        return entry
    scaled = {}
    for key, value in entry.items():
        default, small = _get(config, key), out.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(default, int) and small:
            value = max(1, round(value * small / default)) if default else value
            if key.endswith("head_dim") and value > 1:
                value += value % 2
        scaled[key] = value
    return scaled


def _get(config: PretrainedConfig, key: str) -> Any:
    """``config.key``, or None where reading it raises (per-layer attributes of heterogeneous configs)."""
    try:
        return getattr(config, key, None)
    except Exception:  # e.g. transformers' AmbiguousGlobalPerLayerAttributeError: read the global value
        return vars(config).get(key)


def _init_fields(config: PretrainedConfig) -> set[str]:
    if dataclasses.is_dataclass(config):
        return {f.name for f in dataclasses.fields(config) if f.init} - {"model_type", "transformers_version"}
    return set(config.to_dict()) - {"model_type", "transformers_version", "architectures", "_name_or_path"}


def _layer_index(key: Any, n: int) -> bool:
    try:
        return 0 <= int(key) < n
    except (TypeError, ValueError):
        return False


def _per_layer(values: list, n: int) -> list:
    """A per-layer list for ``n`` layers: every distinct entry of ``values`` in order of first appearance,
    cycled (so that a hybrid pattern keeps each of its layer kinds)."""
    kinds = list({repr(v): v for v in values}.values())
    return [kinds[i % len(kinds)] for i in range(n)]


def tiny_model(model_type: str) -> torch.nn.Module:
    """The tiny random model of ``model_type`` (seed 0, fp32, eval, no gradients)."""
    config = tiny_config(model_type)
    torch.manual_seed(0)
    try:
        model = _quiet(AutoModelForCausalLM.from_config, config)
    except Exception as err:
        raise NotBuildable(f"the small model does not build: {_short(err)}") from err
    n_params = sum(p.numel() for p in model.parameters())
    if n_params > 50_000_000:
        raise NotBuildable(f"not small: {n_params / 1e6:.0f}M parameters after shrinking")
    return model.float().eval().requires_grad_(False)


def stream_tokens(model: torch.nn.Module, n: int = N_TOKENS, seed: int = 0) -> torch.Tensor:
    """``n`` seeded random token ids of the small vocabulary, avoiding the config's special (e.g. image)
    token ids that a bare text stream must not contain."""
    config = model.config
    vocab = config.get_text_config().vocab_size
    special = set()
    for sub in (config, config.get_text_config()):
        for key, value in sub.to_dict().items():
            if ("token_id" in key or "token_index" in key) and key not in ("bos_token_id", "eos_token_id"):
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, int):
                        special.add(v)
    allowed = torch.tensor([t for t in range(vocab) if t not in special])
    generator = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(allowed.numel(), (n,), generator=generator)]


# ---- the checks ---------------------------------------------------------------------------------
@dataclass
class _Case:
    name: str
    policy: str
    budget: int
    chunk: int
    positions: str
    against: str  # "own": the model's forward; "reference": reference_stream
    scope: str = "head"


def cases(n: int = N_TOKENS, scope: str = "head") -> list[_Case]:
    """The cases of a row; ``scope``: that of the ``h2o`` cases (``layer`` where heads share entries)."""
    named = "" if scope == "head" else f" scope={scope}"
    own = [
        _Case("full", "full", None, 64, "original", "own"),
        _Case(f"window B={n}", "window", n, 64, "original", "own"),
        _Case(f"h2o B={n} C={FULL_CHUNK}{named}", "h2o", n, FULL_CHUNK, "original", "own", scope),
    ]
    bounded = [
        _Case(
            f"{policy} B={BUDGET} C={CHUNK} {positions}{named if policy == 'h2o' else ''}",
            policy,
            BUDGET,
            CHUNK,
            positions,
            "reference",
            scope if policy == "h2o" else "head",
        )
        for positions in ("original", "cache")
        for policy in ("window", "h2o")
    ]
    return own + bounded


def own_nll(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [n - 1] of the model's own forward pass (its default attention)."""
    with torch.no_grad():
        logits = model(input_ids=tokens[None], use_cache=False).logits[0].float()
    return -torch.log_softmax(logits[:-1], dim=-1).gather(-1, tokens[1:, None])[:, 0]


def engine_nll(model: torch.nn.Module, tokens: torch.Tensor, case: _Case) -> torch.Tensor:
    """Per-token NLL [n - 1] of ``tokens`` streamed by :func:`rmm.evaluate` under ``case``."""
    run = evaluate(
        model,
        token_ids=[tokens],
        policy=case.policy,
        budget=case.budget,
        chunk=case.chunk,
        positions=case.positions,
        scope=case.scope,
    )
    return torch.from_numpy(run.tokens["nll"].iloc[1:].to_numpy(dtype="float32"))  # position 0: no NLL


def classify(model_type: str, timeout_s: float | None = TIMEOUT_S) -> Row:
    """Build the tiny model of ``model_type`` and check the harness on it (see the module docstring)."""
    try:
        with _deadline(timeout_s):
            return _classify(model_type)
    except NotBuildable as err:
        return Row(model_type, "skipped", str(err))
    except _Timeout:
        return Row(model_type, "skipped", f"timed out after {timeout_s:g} s")
    finally:
        gc.collect()


def _classify(model_type: str) -> Row:
    model = tiny_model(model_type)
    tokens = stream_tokens(model)
    try:
        own = own_nll(model, tokens)
    except Exception as err:
        why = f"the model's own forward fails: {_short(err)}"
        try:  # what the harness says of it without the model's forward pass
            StreamingEngine(model, make_policy({"name": "full"}, budget=None, chunk=64))
        except UnsupportedModelError as refusal:
            return Row(model_type, "refused", f"{_short(refusal, 160)} ({why})")
        except Exception as harness:
            why += f"; the harness raised {type(harness).__name__}: {_short(harness, 80)}"
        raise NotBuildable(why) from err
    if not torch.isfinite(own).all():
        raise NotBuildable("the model's own forward gives non-finite NLL")
    wrong, crashed, refused, no_reference, exact = [], [], [], [], []
    streamed: dict[str, torch.Tensor] = {}
    worst: float | None = None
    shared = latent_attention(model.config.get_text_config())  # heads share each layer's entries
    for case in cases(tokens.numel(), "layer" if shared else "head"):
        try:
            got = engine_nll(model, tokens, case)
        except UnsupportedModelError as err:
            refused.append(f"{case.name}: {_short(err, 160)}")
            continue
        except Exception as err:
            crashed.append(f"{case.name}: {type(err).__name__}: {_short(err)}")
            continue
        streamed[case.name] = got
        if case.against == "own":
            expected = own
        else:
            spec = ReferenceSpec(
                policy=case.policy,
                budget=case.budget,
                chunk=case.chunk,
                positions=case.positions,
                scope=case.scope,
            )
            try:
                expected = reference_stream(model, tokens, spec)[0]
            except Exception as err:
                no_reference.append(f"{case.name}: {type(err).__name__}: {_short(err, 100)}")
                continue
        dnll = float((got.float() - expected.float()).abs().max())
        worst = math.inf if math.isnan(dnll) else max(worst or 0.0, dnll)
        if dnll <= TOLERANCE:
            exact.append(case.name)
        else:
            wrong.append(f"{case.name} vs {case.against}: max |dNLL| {dnll:.3g}")
    if wrong:
        status, parts = "WRONG", wrong + crashed + refused
    elif crashed:
        status, parts = "CRASH", crashed + refused
    elif refused:
        status, parts = "refused", refused[:1]
        if len(refused) > 1:
            parts.append(f"+{len(refused) - 1} more cases refused")
        if exact:
            parts.append(f"exact: {', '.join(exact)}")
    elif no_reference:
        status, parts = "exact (no reference)", [f"reference raised on {no_reference[0]}"]
    else:
        status, parts = "exact", []
    bounded = streamed.get(f"window B={BUDGET} C={CHUNK} original")
    if status.startswith("exact") and bounded is not None:  # the checks' sensitivity
        parts.append(f"window B={BUDGET} moves the NLL by up to {float((bounded - own).abs().max()):.2g}")
    return Row(model_type, status, "; ".join(parts), worst)


# ---- helpers ------------------------------------------------------------------------------------
class _Timeout(BaseException):
    pass


@contextlib.contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`_Timeout` in the block after ``seconds`` (main thread with SIGALRM only)."""
    usable = seconds and hasattr(signal, "SIGALRM")
    if usable:
        try:
            previous = signal.signal(signal.SIGALRM, _alarm)
        except ValueError:  # not the main thread
            usable = False
    if not usable:
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _alarm(signum, frame) -> None:
    raise _Timeout()


def _quiet(function, *args, **kwargs) -> Any:
    """Call ``function`` with transformers' warnings silenced."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return function(*args, **kwargs)
    finally:
        logging.set_verbosity(level)


def _short(err: BaseException | str, limit: int = 200) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- the table ----------------------------------------------------------------------------------
def table(rows: list[Row], command: str, wall_s: float | None = None) -> str:
    """The markdown table (sorted by model type), its summary count line and the command that made it."""
    counts = {status: sum(row.status == status for row in rows) for status in STATUSES}
    summary = ", ".join(f"{status}: {count}" for status, count in counts.items() if count)
    lines = [
        "| model type | status | reason |",
        "|---|---|---|",
        *(
            f"| {r.model_type} | {r.status} | {r.reason.replace('|', '/')} |"
            for r in sorted(rows, key=lambda r: r.model_type)
        ),
        "",
        f"{len(rows)} types: {summary}" + (f" ({wall_s:.0f} s)" if wall_s is not None else ""),
        "",
        f"Made by `{command}`.",
    ]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- architecture matrix: begin -->", "<!-- architecture matrix: end -->"


def write_table(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: between the matrix markers where the file has them (the
    table section of docs/models.md), else as the whole file."""
    old = path.read_text() if path.is_file() else ""
    if BEGIN in old and END in old:
        text = old[: old.index(BEGIN) + len(BEGIN)] + "\n" + text + old[old.index(END) :]
    atomic_write_text(path, text)


def read_rows(path: Path) -> list[Row]:
    """The rows of the table between the matrix markers of ``path`` (none when it has no table)."""
    text = path.read_text() if path.is_file() else ""
    if BEGIN not in text or END not in text:
        return []
    rows = []
    for line in text[text.index(BEGIN) : text.index(END)].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in STATUSES:
            rows.append(Row(*cells))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checks.architectures", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--types", help="comma-separated model types (default: every causal LM type)")
    parser.add_argument("--out", help="write the table here too (between the matrix markers if it has them)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per type")
    parser.add_argument("--update", action="store_true", help="in --out, replace only the rows of --types")
    args = parser.parse_args(argv)
    types = args.types.split(",") if args.types else causal_lm_types()
    torch.set_num_threads(1)
    rows, start = [], time.perf_counter()
    for model_type in types:
        begin = time.perf_counter()
        row = classify(model_type, args.timeout)
        rows.append(row)
        print(
            f"{model_type}: {row.status} ({time.perf_counter() - begin:.1f} s) {row.reason}",
            file=sys.stderr,
            flush=True,
        )
    command = "python -m checks.architectures" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])
    )
    wall_s = time.perf_counter() - start
    if args.update and args.out:
        fresh = {row.model_type for row in rows}
        rows += [row for row in read_rows(Path(args.out)) if row.model_type not in fresh]
        wall_s = None  # the kept rows' time is not this run's
    text = table(rows, command, wall_s)
    print(text)
    if args.out:
        write_table(Path(args.out), text)
    return 1 if any(row.status not in PASSING for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
