"""restkv's ``variant=official``: ReST-KV as the authors' RestKVCluster (an-yongqi/rest-kv,
restkv/restkv_utils.py) scores, in the paper's configuration.

- against the independent reference (rmm/reference.py's ``_restkv_official``) on the tiny models of every
  architecture made multi-head (G = 1: the official code keeps one selection per query head, which a
  per-(layer, KV head) memory holds only then; the matrix's GQA models are refused, tested below);
- the policy's scores against a transcription of ``RestKVCluster.update_kv``'s scoring (metric_mode
  after, use_wo, use_ema, adaptive pooling) on random inputs, to fp32 rounding;
- what the variant refuses, and that the harness variant keeps its parameters and defaults.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from checks.matrix import sampled_stream, tiny_model
from rmm.engine import StreamingEngine, retained_sets_recorder
from rmm.files import config_dir
from rmm.policies import make_policy
from rmm.policies.base import Observation
from rmm.reference import ReferenceSpec, reference_stream

BUDGET, LENGTH = 8, 24
NLL_ATOL = 5e-6  # as tests/test_policies.py
OFFICIAL_CASES = [
    {"variant": "official", "window": 2},
    {"variant": "official", "window": 2, "alpha": 0.5, "kernel": 1, "scale": 1},  # kernels and shifts vary
    {"variant": "official", "window": 4, "kernel": 3, "scale": 2},
]
_MODELS: dict = {}


def multi_head(arch: str):
    """The matrix's tiny ``arch`` with as many KV heads as query heads (G = 1), and a stream it predicts."""
    if arch not in _MODELS:
        model = tiny_model(arch, num_key_value_heads=4)
        _MODELS[arch] = (model, sampled_stream(model, LENGTH))
    return _MODELS[arch]


def cases():
    for arch in ("llama", "qwen2", "mistral", "gpt_neox", "gemma3"):
        for index, params in enumerate(OFFICIAL_CASES):
            for chunk in (2, 4, 5, 6):
                if chunk < params["window"] or params["window"] >= BUDGET - chunk + 1:
                    continue
                fast = arch in ("llama", "gpt_neox", "gemma3") and chunk == 4
                yield pytest.param(
                    arch,
                    params,
                    chunk,
                    id=f"{arch}-{index}-C{chunk}",
                    marks=[pytest.mark.slow] * (not fast),
                )


@pytest.mark.parametrize(("arch", "params", "chunk"), cases())
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_official_matches_reference(arch, params, chunk, positions):
    model, tokens = multi_head(arch)
    spec = ReferenceSpec("restkv", budget=BUDGET, chunk=chunk, positions=positions, **params)
    ref_nll, ref_correct = reference_stream(model, tokens, spec)
    hook, sets = retained_sets_recorder()
    policy = make_policy({"name": "restkv", **params}, budget=BUDGET, chunk=chunk)
    result = StreamingEngine(model, policy, positions=positions).stream(tokens, on_boundary=hook)
    where = f"{arch} {params} chunk={chunk} positions={positions}"
    torch.testing.assert_close(result.nll, ref_nll, rtol=0, atol=NLL_ATOL, msg=where)
    assert torch.equal(result.correct, ref_correct), where
    assert sets and result.evicted_count > 0, where
    for now, engine_set in sets.items():
        assert engine_set == spec.retained_log[now], f"R_{now} differs: {where}"


def window_observation(query, key, value, wo, window: int) -> Observation:
    """The observation of one layer whose last ``window`` queries [1, H, Q, D] attend causally to ``key``,
    with values ``value`` and the output projection ``wo`` [hidden, H * D]."""
    _, heads, q_len, head_dim = query.shape
    logits = query[0, :, -window:] @ key[0].transpose(1, 2) / math.sqrt(head_dim)
    visible = torch.arange(q_len)[None, :] <= torch.arange(q_len - window, q_len)[:, None]
    attention = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)  # [heads, window, q_len]
    return Observation(
        torch.arange(q_len).expand(1, heads, q_len),
        torch.arange(q_len - window, q_len),
        attention=attention[None],
        values=value,
        output_projection=wo.unflatten(1, (heads, head_dim)).permute(1, 0, 2)[None],
    )


def rest_kv_cluster_scores(
    query, key, value, wo, window, capacity, kernel=5, alpha=0.3, scale=2000
) -> torch.Tensor:
    """A transcription of RestKVCluster.update_kv's scoring (restkv/restkv_utils.py of an-yongqi/rest-kv)
    with use_wo, use_ema, metric_mode='after', pooling='adaptive', tau 1, no pyramid: query, key, value
    [1, heads, q_len, D] (after repeat_kv), wo the o_proj weight [hidden, heads * D]. Returns the pooled
    scores of the keys before the window, [1, heads, q_len - window], the code's ``attn_cache``."""
    _, heads, q_len, head_dim = query.shape
    logits = query[..., -window:, :] @ key.transpose(2, 3) / math.sqrt(head_dim)
    causal = torch.full((window, window), torch.finfo(logits.dtype).min)
    causal = causal.masked_fill(torch.arange(window) < (torch.arange(window) + 1)[:, None], 0.0)
    logits[..., -window:] += causal
    attn = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [1, heads, window, q_len]
    return scores_from_attention(attn, value, wo, window, capacity, kernel, alpha, scale)


def scores_from_attention(attn, value, wo, window, capacity, kernel=5, alpha=0.3, scale=2000) -> torch.Tensor:
    """The rest of RestKVCluster.update_kv's scoring, from the window's attention ``attn`` [1, heads,
    window, q_len] over the keys in position order (the window's own last) and their ``value``."""
    _, heads, _, q_len = attn.shape
    head_dim = value.shape[-1]
    rows = attn[..., : q_len - window]  # the window's queries on the keys before it
    m = rows[..., 0, :].clone()  # the code's ema(): started at the first, m = alpha x + (1 - alpha) m
    for i in range(1, window):
        m = alpha * rows[..., i, :] + (1 - alpha) * m
    out = torch.einsum("bhl,bhld->bhd", m, value[..., : q_len - window, :])
    score = m / (1 - m)
    per_head = wo.reshape(-1, heads, head_dim)  # [hidden, heads, D]
    projected_out = torch.einsum("bhd,chd->bhc", out, per_head)
    projected_values = torch.einsum("bhld,chd->bhlc", value, per_head)
    score = score * (projected_out[:, :, None] - projected_values[:, :, : q_len - window]).norm(dim=-1)
    # adaptive pooling: index shift of the top (capacity - window) keys between the window's two halves
    first = attn[0, :, : window // 2].sort()[1][:, :, window - capacity :]
    second = attn[0, :, window // 2 :].sort()[1][:, :, window - capacity :]
    t = (first - second).float().mean(dim=(1, 2))
    sizes = 2 * (t.abs() // scale) + 1
    shifts = torch.where(t > 0, t // scale, t // scale + 1)
    pooled = []
    for h in range(heads):
        size, shift = max(kernel, int(sizes[h])), int(shifts[h])
        padded = F.pad(score[:, h], (size // 2 - shift, size // 2 + shift), mode="replicate")
        pooled.append(F.avg_pool1d(padded, kernel_size=size, stride=1))
    return torch.stack(pooled, dim=1)


@pytest.mark.parametrize(
    ("q_len", "window", "capacity", "kernel", "alpha", "scale", "seed"),
    [
        (40, 4, 12, 5, 0.3, 2000, 0),  # the paper's alpha and scale: kernel 5, shift 0 or 1
        (40, 8, 20, 5, 0.3, 2000, 1),
        (33, 2, 9, 3, 0.5, 1, 2),  # scale 1: kernels and shifts from the ranking's drift
        (48, 6, 16, 1, 0.2, 2, 3),
        (24, 4, 24, 5, 0.3, 3, 4),  # capacity = q_len: every key ranked
    ],
)
def test_official_scores_equal_rest_kv_cluster(q_len, window, capacity, kernel, alpha, scale, seed):
    """At one boundary over a whole prompt (the official code's one-shot setting: the chunk is the
    window, the budget keeps ``capacity``), the policy's scores of the keys before the window equal the
    transcribed RestKVCluster's, and the window's own keys are always kept."""
    generator = torch.Generator().manual_seed(seed)
    heads, head_dim, hidden = 3, 8, 12
    query, key, value = (torch.randn(1, heads, q_len, head_dim, generator=generator) * 2 for _ in range(3))
    wo = torch.randn(hidden, heads * head_dim, generator=generator)
    expected = rest_kv_cluster_scores(query, key, value, wo, window, capacity, kernel, alpha, scale)[0]
    obs = window_observation(query, key, value, wo, window)
    params = {"name": "restkv", "variant": "official", "window": window, "kernel": kernel}
    policy = make_policy(
        {**params, "alpha": alpha, "scale": scale}, budget=capacity + window - 1, chunk=window
    )
    assert policy.capacity == capacity
    scores = policy.score({}, obs, q_len)[0]
    torch.testing.assert_close(scores[:, : q_len - window].float(), expected, rtol=2e-5, atol=1e-6)
    assert torch.isinf(scores[:, q_len - window :]).all()


@pytest.mark.parametrize(
    ("window", "chunk", "kernel", "alpha", "scale", "seed"),
    [(4, 7, 5, 0.3, 2000, 0), (4, 7, 3, 0.3, 1, 1), (6, 6, 1, 0.5, 3, 2), (2, 5, 5, 0.2, 2, 3)],
)
def test_official_scores_equal_rest_kv_cluster_at_a_later_boundary(window, chunk, kernel, alpha, scale, seed):
    """At a boundary deep in a stream, over a memory's slots (two layers; each head's own retained
    positions with gaps, in shuffled slots, some empty; more chunk queries than the window), each head's
    scores equal the transcribed RestKVCluster's over its valid keys in position order."""
    generator = torch.Generator().manual_seed(seed)
    layers, heads, head_dim, hidden, n_old, empty, now = 2, 3, 8, 10, 30, 3, 100
    slots = n_old + chunk + empty
    key_pos = torch.full((layers, heads, slots), -1)
    for layer, head in itertools.product(range(layers), range(heads)):
        old = torch.randperm(now - chunk, generator=generator)[:n_old].sort().values
        held = torch.cat([old, torch.arange(now - chunk, now), torch.full((empty,), -1)])
        key_pos[layer, head] = held[torch.randperm(slots, generator=generator)]
    query_pos = torch.arange(now - chunk, now)
    visible = (key_pos[:, :, None, :] >= 0) & (key_pos[:, :, None, :] <= query_pos[:, None])
    logits = torch.randn(layers, heads, chunk, slots, generator=generator, dtype=torch.float64) * 3
    attention = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
    values = torch.randn(layers, heads, slots, head_dim, generator=generator, dtype=torch.float64)
    projection = torch.randn(layers, heads, hidden, head_dim, generator=generator, dtype=torch.float64)
    obs = Observation(key_pos, query_pos, attention=attention, values=values, output_projection=projection)
    capacity = n_old + chunk - 16  # B': the oldest candidates compete for fewer slots than they hold
    params = {"name": "restkv", "variant": "official", "window": window, "kernel": kernel, "alpha": alpha}
    policy = make_policy({**params, "scale": scale}, budget=capacity + chunk - 1, chunk=chunk)
    scores = policy.score({}, obs, now)
    for layer, head in itertools.product(range(layers), range(heads)):
        order = torch.argsort(torch.where(key_pos[layer, head] >= 0, key_pos[layer, head], now * 2))
        order = order[: int((key_pos[layer, head] >= 0).sum())]
        attn = attention[layer, head][-window:, order][None, None]
        wo = projection[layer, head]  # [hidden, D]: the head's own columns
        expected = scores_from_attention(
            attn, values[layer, head][order][None, None], wo, window, capacity, kernel, alpha, scale
        )[0, 0]
        got = scores[layer, head][order]
        torch.testing.assert_close(got[: len(order) - window], expected, rtol=1e-12, atol=0)
        assert torch.isinf(got[len(order) - window :]).all()


def test_official_refuses_grouped_query_attention():
    """The official code keeps a selection per query head: a GQA model (G = 2) is refused, naming the fix."""
    model = tiny_model("llama")
    policy = make_policy({"name": "restkv", "variant": "official", "window": 2}, budget=BUDGET, chunk=4)
    with pytest.raises(ValueError, match="4 query heads per KV head|2 query heads per KV head"):
        StreamingEngine(model, policy).stream(sampled_stream(model, 12))
    with pytest.raises(ValueError, match="G = 1"):
        reference_stream(
            model, sampled_stream(model, 12), ReferenceSpec("restkv", BUDGET, 4, variant="official", window=2)
        )


@pytest.mark.parametrize(
    ("params", "chunk", "message"),
    [
        ({"variant": "paper"}, 4, "policy.variant must be one of"),
        ({"window": 4}, 4, "policy.window is a parameter of policy.variant=official"),
        ({"alpha": 0.2}, 4, "policy.alpha is a parameter of policy.variant=official"),
        ({"variant": "official", "beta": 0.7, "window": 2}, 4, "policy.beta is the harness variant's"),
        ({"variant": "official", "window": 3}, 4, "policy.window must be an even integer"),
        ({"variant": "official", "window": 4}, 2, r"policy.window \(4\) must not exceed chunk"),
        ({"variant": "official", "window": 4}, 5, r"policy.window \(4\) must be smaller"),
        ({"variant": "official", "window": 2, "scale": 0}, 4, "policy.scale must be an integer"),
        ({"variant": "official", "window": 2, "alpha": 1.5}, 4, "policy.alpha must be in"),
    ],
)
def test_restkv_refuses(params, chunk, message):
    with pytest.raises(ValueError, match=message):
        make_policy({"name": "restkv", **params}, budget=BUDGET, chunk=chunk)


def test_config_defaults_and_run_names():
    """conf/policy/restkv.yaml: the harness variant by default with its old run name; the official
    variant's defaults are the paper's configuration; its parameters come with a plus and name the run."""
    import rmm.config  # noqa: F401  (the resolvers)

    node = OmegaConf.load(config_dir() / "policy" / "restkv.yaml")
    assert node.variant == "harness" and node.tag == "_b0.8_k5"
    policy = make_policy(OmegaConf.to_container(node, resolve=True), budget=64, chunk=32)
    assert (policy.variant, policy.beta, policy.kernel, policy.protected) == ("harness", 0.8, 5, 0)
    node.variant = "official"
    assert node.tag == "_k5_official_w32_a0.3_s2000"
    policy = make_policy(OmegaConf.to_container(node, resolve=True), budget=64, chunk=32)
    official = (policy.window, policy.alpha, policy.scale, policy.kernel, policy.protected)
    assert official == (32, 0.3, 2000, 5, 32)
    node.window, node.alpha = 16, 0.2
    assert node.tag == "_k5_official_w16_a0.2_s2000"
    assert make_policy(OmegaConf.to_container(node, resolve=True), budget=64, chunk=32).window == 16


def test_official_shift_at_no_drift():
    """t = 0 (the window's halves rank the same keys highest) shifts the official kernel by one place to
    the right (its shift is floor(t / scale) + 1 unless t > 0); the policy does the same."""
    generator = torch.Generator().manual_seed(5)
    heads, head_dim, hidden, q_len, window, capacity = 2, 8, 6, 20, 2, 8
    query, key, value = (torch.randn(1, heads, q_len, head_dim, generator=generator) for _ in range(3))
    query[..., -2, :] = query[..., -1, :]  # the window's two queries alike
    key[..., -1, :] = -4 * query[..., -1, :]  # the last key hardly attended: both rank the same keys
    wo = torch.randn(hidden, heads * head_dim, generator=generator)
    expected = rest_kv_cluster_scores(query, key, value, wo, window, capacity)[0]
    obs = window_observation(query, key, value, wo, window)
    policy = make_policy(
        {"name": "restkv", "variant": "official", "window": window},
        budget=capacity + window - 1,
        chunk=window,
    )
    kernel, shift = policy._adaptive(obs.attention.double(), obs.key_pos >= 0, obs.key_pos)
    assert kernel.tolist() == [[5, 5]] and shift.tolist() == [[1, 1]]
    scores = policy.score({}, obs, q_len)[0]
    torch.testing.assert_close(scores[:, : q_len - window].float(), expected, rtol=2e-5, atol=1e-6)
