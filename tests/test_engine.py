"""The engine: exactness against plain forward passes, rotations, bounded memory, clear errors."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import STREAM_LENGTH, record_max
from omegaconf import OmegaConf

from checks.matrix import distinct_stream
from rmm import memory as slot_memory
from rmm.engine import StreamingEngine, top_two
from rmm.lookahead import RequestRecorder, record_future
from rmm.masks import ChunkMasks, additive, visible_count
from rmm.options import POSITIONS
from rmm.planning import recording_plan
from rmm.policies import Observation, make_policy
from rmm.policies.knorm import KNorm
from rmm.rotary import Rotary
from rmm.timing import PassClock, StreamTime
from rmm.transfer import to_device

NLL_ATOL = 5e-6  # per token, fp32 (measured: 1.4e-6 for full, 2.4e-6 over the reference matrix)
SMOLLM2_NLL_ATOL = 5e-5  # per token, 30 layers of fp32 on real weights (measured 1.5e-5)


def forward_nll(model, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token NLL [n - 1] of one plain forward pass (sdpa): -log_softmax(logits)[p - 1, x_p]."""
    model.set_attn_implementation("sdpa")
    log_probs = torch.log_softmax(model(tokens[None], use_cache=False).logits[0, :-1].float(), -1)
    return -log_probs.gather(-1, tokens[1:, None])[:, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt_neox"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_full_equals_plain_forward(tiny_models, streams, arch, chunk, positions):
    """``full`` per token against the log-softmax of a plain forward pass."""
    model, tokens = tiny_models[arch], streams[arch]
    expected = forward_nll(model, tokens)
    policy = make_policy({"name": "full"}, None, chunk)
    result = StreamingEngine(model, policy, positions=positions).stream(tokens)
    record_max("per-token |NLL full - plain forward|, fp32", float((result.nll - expected).abs().max()))
    torch.testing.assert_close(result.nll, expected, rtol=0, atol=NLL_ATOL)
    assert torch.equal(result.correct, model(tokens[None]).logits[0, :-1].argmax(-1) == tokens[1:])


@pytest.mark.slow
def test_full_equals_plain_forward_smollm2():
    pytest.importorskip("gguf")
    from rmm.data import load_documents
    from rmm.models import load_model

    model, tokenizer = load_model(
        OmegaConf.load("conf/model/smollm2_135m.yaml"), torch.device("cpu"), torch.float32
    )
    data = OmegaConf.merge(OmegaConf.load("conf/dataset/shakespeare.yaml"), {"n_docs": 1, "max_tokens": 300})
    tokens = load_documents(data, tokenizer)[0][0].tokens
    expected = forward_nll(model, tokens)
    result = StreamingEngine(model, make_policy({"name": "full"}, None, 64)).stream(tokens)
    record_max(
        "per-token |NLL full - plain forward|, SmolLM2 fp32", float((result.nll - expected).abs().max())
    )
    torch.testing.assert_close(result.nll, expected, rtol=0, atol=SMOLLM2_NLL_ATOL)


def test_rotation_composes_with_the_models_rope(tiny_models):
    """Rotating a key rotated at p by d equals the model's own rotation at p + d."""
    model = tiny_models["llama"]
    rotary = Rotary(model)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.randn(1, 2, 5, 16)
    positions = torch.tensor([[0, 3, 17, 100, 511]])
    cos, sin = model.model.rotary_emb(x, positions)
    at_p, _ = apply_rotary_pos_emb(x, x, cos, sin)
    delta = torch.tensor([5, -3, 0, 400, -511])
    cos2, sin2 = model.model.rotary_emb(x, positions + delta)
    at_p_plus_d, _ = apply_rotary_pos_emb(x, x, cos2, sin2)
    torch.testing.assert_close(rotary.rotate(at_p[0], delta), at_p_plus_d[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotary.rotate(rotary.rotate(x, delta), -delta), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["window", "streaming_llm", "h2o", "rmm", "oracle"])
def test_memory_does_not_grow_with_the_stream(tiny_models, name):
    """The memory keeps one size during a stream, and is as large after 2300 tokens as after 1100."""
    model = tiny_models["llama"]

    def memory_bytes(n: int) -> int:
        tokens = torch.arange(n) % model.config.vocab_size
        policy = make_policy({"name": name, **({"lag": 4} if name == "rmm" else {})}, budget=16, chunk=8)
        policy.prepare(tokens, lambda stream: record_future(model, stream, tau=0.02, context=64))
        seen = []

        def hook(view, now, evicted):
            memory = view.memory  # the batch's memory, of which the stream's view is one row
            tensors = [memory.keys, memory.values, memory.key_pos, *memory.state.values()]
            tensors += [t for t in (memory.attn, memory.raw_keys) if t is not None]
            seen.append(sum(t.numel() * t.element_size() for t in tensors))

        StreamingEngine(model, policy).stream(tokens, on_boundary=hook)
        assert len(set(seen)) == 1, "the memory changed size during the stream"
        return seen[-1]

    assert memory_bytes(1_100) == memory_bytes(2_300)  # beyond one forward pass of the longest chunk


def test_attended_counts_follow_the_budget(tiny_models, streams):
    """window: query t attends min(t, B) past entries, whatever the chunk."""
    tokens = streams["llama"]
    budget, n = 10, tokens.numel()
    expected = sum(min(t, budget) for t in range(n))
    for chunk in (1, 3, 10):
        engine = StreamingEngine(tiny_models["llama"], make_policy({"name": "window"}, budget, chunk))
        assert engine.stream(tokens).attended_total == pytest.approx(expected)


@pytest.mark.parametrize(
    ("cfg", "budget", "chunk", "message"),
    [
        ({"name": "nope"}, 64, 8, "unknown policy 'nope'"),
        ({"name": "streaming_llm", "sinks": 4}, 4, 1, "cannot hold the 4 sinks"),
        ({"name": "window"}, 64, 0, "chunk must be >= 1"),
        ({"name": "window"}, 8, 16, "must not exceed budget"),
        ({"name": "rmm", "lag": 64}, 64, 1, "lag (64) must be smaller"),
        ({"name": "rmm", "lag": 60}, 64, 8, "budget - chunk + 1 = 57"),
        ({"name": "rmm", "lag": 8, "weight": "maybe"}, 64, 8, "policy.weight must be one of"),
        ({"name": "rmm", "lag": 8, "after_commit": "later"}, 64, 8, "policy.after_commit must be one of"),
        ({"name": "rmm"}, 64, 8, "missing 1 required positional argument: 'lag'"),
        ({"name": "snapkv", "window": 60}, 64, 8, "policy.window (60) must be smaller"),
        ({"name": "snapkv", "kernel": 4}, 64, 8, "policy.kernel must be an odd integer"),
        ({"name": "snapkv", "pooling": "median"}, 64, 8, "policy.pooling must be one of"),
        ({"name": "lru", "tau": 0.0}, 64, 8, "policy.tau must be > 0"),
        ({"name": "lagkv", "partition": 1}, 64, 8, "policy.partition must be >= 2"),
        ({"name": "lagkv", "partition": 28}, 64, 8, "policy.sinks + 2 * policy.partition - 1 (59)"),
        ({"name": "restkv", "beta": 1.0}, 64, 8, "policy.beta must be in [0, 1)"),
        ({"name": "restkv", "kernel": 2}, 64, 8, "policy.kernel must be an odd integer"),
        ({"name": "expected_attention", "n_future_positions": 0}, 64, 8, "policy.n_future_positions must be"),
        ({"name": "expected_attention", "sinks": 57}, 64, 8, "policy.sinks (57) must be smaller"),
        ({"name": "expected_attention", "epsilon": -1.0}, 64, 8, "policy.epsilon must be >= 0"),
        ({"name": "h2o", "rho": 1.0}, 64, 8, "policy.rho must be in [0, 1)"),
        ({"name": "random", "rho": -0.1}, 64, 8, "policy.rho must be in [0, 1)"),
        ({"name": "oracle", "variant": "psychic"}, 64, 8, "policy.variant must be one of"),
        ({"name": "window", "sinks": 3}, 64, 8, "bad parameters for policy 'window'"),
    ],
)
def test_bad_policy_input_is_explained(cfg, budget, chunk, message):
    with pytest.raises(ValueError, match=None) as err:
        make_policy(cfg, budget, chunk)
    assert message in str(err.value)


def test_bad_stream_input_is_explained(tiny_models):
    model = tiny_models["llama"]
    engine = StreamingEngine(model, make_policy({"name": "window"}, 16, 4))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        engine.stream(torch.tensor([3]))
    with pytest.raises(ValueError, match="positions must be one of"):
        StreamingEngine(model, make_policy({"name": "window"}, 16, 4), positions="absolute").stream(
            torch.arange(5)
        )
    with pytest.raises(ValueError, match="oracle.tau must be > 0"):
        RequestRecorder(tau=0.0)


def test_observation_names_the_missing_need():
    obs = Observation(torch.zeros(1, 1, 2, dtype=torch.long), torch.arange(2))
    with pytest.raises(AttributeError, match="add 'keys' to the policy's `needs`"):
        _ = obs.keys
    with pytest.raises(AttributeError, match="add 'outcomes'"):
        _ = obs.prob


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_observed_keys_and_queries_are_unrotated(tiny_models, arch):
    """Keys and queries handed to a policy are pre-RoPE: at layer 0 (where they depend on the token
    only) equal under both position modes, and equal to the model's keys rotated back."""
    model, tokens = (
        tiny_models[arch],
        distinct_stream(STREAM_LENGTH),
    )  # repeated tokens would tie knorm's ranking
    seen = {}

    class Probe(KNorm):
        needs = frozenset({"keys", "values", "queries"})

        def observe(self, state, obs):
            seen.setdefault(self.mode, []).append(
                (obs.key_pos.clone(), obs.keys.clone(), obs.queries.clone())
            )

    for mode in POSITIONS:
        probe = Probe(budget=12, chunk=4)
        probe.mode = mode
        engine = StreamingEngine(model, probe, positions=mode)
        memory = engine.new_memory(tokens.numel(), engine.plan.recording)
        assert memory.attn is None, "an attention-free policy must not record attention"
        engine.stream(tokens)
    for (pos_o, keys_o, queries_o), (pos_c, keys_c, queries_c) in zip(*seen.values(), strict=True):
        assert torch.equal(pos_o[0], pos_c[0])
        valid = pos_o[0] >= 0
        torch.testing.assert_close(keys_o[0][valid], keys_c[0][valid], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(queries_o[0], queries_c[0], atol=1e-5, rtol=1e-5)
    # the first chunk's keys against a plain eager pass, rotated back by the models' own RoPE
    model.set_attn_implementation("eager")
    out = model(tokens[None, :4], use_cache=True)
    rotary = Rotary(model)
    model_keys = out.past_key_values.layers[0].keys[0]  # [H, 4, D], rotated at 0..3
    first_pos, first_keys, _ = seen["original"][0]  # the first chunk: slots R.. hold positions 0..3
    filled = first_pos[0, 0] >= 0
    assert torch.equal(first_pos[0, 0, filled], torch.arange(4))
    expected = rotary.rotate(model_keys, -torch.arange(4))
    torch.testing.assert_close(first_keys[0][:, filled], expected, atol=1e-5, rtol=1e-5)


def test_attention_free_policies_keep_the_fused_path(tiny_models):
    """Only policies that declare attention make the memory record probabilities (the eager path)."""
    model = tiny_models["llama"]
    for name, params in [
        ("knorm", {}),
        ("keydiff", {}),
        ("lagkv", {"partition": 2, "sinks": 0}),
        ("expected_attention", {"sinks": 0}),
        ("h2o", {}),
    ]:
        policy = make_policy({"name": name, **params}, budget=12, chunk=4)
        memories = []
        StreamingEngine(model, policy).stream(
            torch.arange(10), on_boundary=lambda m, *_, seen=memories: seen.append(m)
        )
        assert (memories[0].memory.attn is not None) == (name == "h2o"), name


@pytest.mark.parametrize("width", [5, 64, 65, 100, 128])
def test_top_two_equals_topk(width):
    """The blocked top-two (blocks of 16 here: one that ends short, one exactly) is topk's, ties of the
    largest across and inside blocks included."""
    x = torch.randn(3, 7, width, generator=torch.Generator().manual_seed(width))
    x[0, 0, -1] = x[0, 1, 0] = x[0, 1, width // 2] = 9.0  # the largest in the last block; a tie
    x[1, 0, :2] = torch.tensor([8.0, 7.5])  # the runner-up in the largest's block
    best, argmax, runner_up = top_two(x, block=16)
    top = x.topk(2, dim=-1)
    assert torch.equal(best, top.values[..., 0]) and torch.equal(runner_up, top.values[..., 1])
    assert torch.equal(x.gather(-1, argmax[..., None])[..., 0], best)  # the index holds the largest
    untied = torch.ones_like(best, dtype=torch.bool)
    untied[0, 1] = False
    assert torch.equal(argmax[untied], top.indices[..., 0][untied])


@pytest.mark.parametrize("move_bytes", [1, 2**62])  # a layer per call (a CPU), every layer at once
def test_compaction_moves_whole_slots(move_bytes, monkeypatch):
    """move_slots is gather along the slot dim with the index expanded over the entries, in layer blocks
    or all at once."""
    monkeypatch.setattr(slot_memory, "CPU_MOVE_BYTES", move_bytes)
    tensor = torch.randn(3, 2, 2, 9, 4)
    index = torch.rand(3, 2, 2, 9).argsort(dim=-1)[..., :5]
    expected = torch.gather(tensor, 3, index[..., None].expand(*index.shape, 4))
    slot_memory.move_slots(tensor, slot_memory.slot_rows(index, 9))
    assert torch.equal(tensor[..., :5, :], expected)


N_LAYERS, ROWS, HEADS, RETAINED, N_Q = 3, 2, 2, 6, 4  # the hand-made pass of the mask tests below


def hand_made_pass(padded: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A score-based pass by hand: key positions [L, N, H, R + Q] (each pair holding 0 to R retained
    entries, some empty), query positions [N, Q] and, where ``padded``, the padded queries [N, Q] (row 1's
    last two)."""
    generator = torch.Generator().manual_seed(0)
    held = torch.randint(0, RETAINED + 1, (N_LAYERS, ROWS, HEADS), generator=generator)
    key_pos = torch.full((N_LAYERS, ROWS, HEADS, RETAINED + N_Q), -1)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in held.shape)).tolist():
        count = int(held[tuple(index)])
        kept = torch.randperm(10, generator=generator)[:count].sort().values
        key_pos[(*index, slice(0, count))] = kept
    query_pos = torch.tensor([10, 14])[:, None] + torch.arange(N_Q)
    pad = torch.arange(N_Q) >= torch.tensor([N_Q, 2])[:, None] if padded else None
    key_pos[..., RETAINED:] = (query_pos if pad is None else query_pos.masked_fill(pad, -1))[:, None]
    return key_pos, query_pos, pad


def hand_made_masks() -> ChunkMasks:
    """An empty :class:`~rmm.masks.ChunkMasks` for :func:`hand_made_pass` under h2o."""
    plan = recording_plan(make_policy({"name": "h2o"}, 8, N_Q), "original")
    return ChunkMasks(plan, [HEADS] * N_LAYERS, 0, torch.float32)


@pytest.mark.parametrize("padded", [False, True])
def test_the_eager_bias_hides_what_the_blocked_mask_hides(padded):
    """A score-based pass's additive mask for the eager path, built from two small parts, is -inf exactly
    where the blocked mask over [L, N, H, Q, S] is true and 0 elsewhere: empty retained slots, the chunk's
    later keys, padded queries (their own slot only), and a windowed layer's own mask."""
    from rmm.integration import Visibility

    key_pos, query_pos, pad = hand_made_pass(padded)
    eager, blocked = hand_made_masks(), hand_made_masks()
    eager.begin(key_pos, query_pos, pad, blocked=False, sinks=False, eager=True)
    blocked.begin(key_pos, query_pos, pad, blocked=True, sinks=False)
    assert eager.blocked is None and eager._allowed is None  # nothing [L, N, H, Q, S] is built
    for masks in (eager, blocked):
        masks.enter_layer(1, Visibility(None, 5), key_pos)
    for layer in range(N_LAYERS):
        expected = additive(blocked.hidden(layer))
        assert torch.equal(eager.eager_bias(layer), expected.expand(ROWS, HEADS, N_Q, -1))
    assert torch.equal(eager.allowed, blocked.allowed)  # built on demand, the same


@pytest.mark.parametrize("padded", [False, True])
def test_attended_counts_without_the_allowed_mask_equal_counting_it(padded):
    """A score-based pass counts each query's visible entries from the held ones (the allowed mask is not
    built where only its complement is needed): the same as counting the mask, a windowed layer's too,
    and averaged over the (layer, KV head) pairs that hold entries where some hold none."""
    from rmm.integration import Visibility

    n_layers, heads = N_LAYERS, HEADS
    key_pos, query_pos, pad = hand_made_pass(padded)
    masks = hand_made_masks()
    masks.begin(key_pos, query_pos, pad, blocked=True, sinks=False)
    masks.enter_layer(1, Visibility(None, 5), key_pos)
    assert masks._allowed is None
    allowed = [
        masks.layers[layer][0] if layer in masks.layers else ~masks.blocked[layer] for layer in range(3)
    ]
    counts = torch.stack([visible_count(a) for a in allowed]) - 1  # [L, N, H, Q]
    expected = counts.mean(dim=(0, 2))  # [N, Q]
    expected = expected.masked_fill(pad, 0) if padded else expected
    assert torch.equal(masks.attended(n_layers, heads, None), expected)
    # (layer, KV head) pairs that hold nothing are left out of the average (computed without indexing)
    empty = torch.tensor([[False, False], [False, True], [True, False]])[:, None, :, None]  # [L, 1, H, 1]
    over_held = counts.transpose(1, 2)[~empty[:, 0, :, 0]].mean(dim=0)  # [N, Q]
    over_held = over_held.masked_fill(pad, 0) if padded else over_held
    assert torch.equal(masks.attended(n_layers, heads, empty), over_held)


def test_to_device_stages_host_values_in_pinned_memory_on_cuda():
    """On a CUDA device host values go through pinned memory and a non-blocking copy (a pageable copy
    waits for the device's stream); elsewhere they are a plain tensor with the values and dtype asked."""
    plain = to_device([[1, 2], [3, 4]], torch.device("cpu"))
    assert plain.dtype == torch.long and plain.tolist() == [[1, 2], [3, 4]]
    assert to_device([True, False], torch.device("cpu")).dtype == torch.bool
    assert to_device([1, 2], torch.device("cpu"), torch.float32).dtype == torch.float32
    staged = mock.MagicMock()
    with mock.patch("torch.tensor", return_value=staged) as made:
        to_device([1, 2], torch.device("cuda", 0))
    made.assert_called_once_with([1, 2], dtype=None, pin_memory=True)
    staged.to.assert_called_once_with(torch.device("cuda", 0), non_blocking=True)


class _FakeEvent:
    """A CUDA timing event on a fake device clock (seconds), recording who waited on it."""

    clock = 0.0
    waited: list[_FakeEvent] = []

    def __init__(self, enable_timing: bool):
        assert enable_timing

    def record(self, stream: object) -> None:
        self.at = _FakeEvent.clock

    def synchronize(self) -> None:
        _FakeEvent.waited.append(self)

    def elapsed_time(self, end: _FakeEvent) -> float:  # milliseconds, as CUDA's
        return (end.at - self.at) * 1e3


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_pass_clock_shares_each_pass_among_its_rows_and_waits_once_per_stream(device):
    """Each pass's time is shared equally by its rows; on CUDA it is read from events only when a stream's
    total is asked for, with one wait (on its last pass's end), never while passes run."""
    clock = PassClock(torch.device(device))
    a, b, c = StreamTime(), StreamTime(), StreamTime()
    _FakeEvent.clock, _FakeEvent.waited = 0.0, []
    host = [0.0, 2.0, 2.0, 3.0, 3.0, 6.0]  # the host clock at each start and stop
    with (
        mock.patch("torch.cuda.Event", _FakeEvent),
        mock.patch("torch.cuda.current_stream"),
        mock.patch("rmm.timing.time.perf_counter", side_effect=host),
    ):
        for rows, seconds in (([a, b], 2.0), ([a], 1.0), ([a, b, c], 3.0)):
            start = clock.start()
            _FakeEvent.clock += seconds  # the pass's kernels run
            clock.stop(start, rows)
        assert _FakeEvent.waited == []
        assert [a.seconds, b.seconds, c.seconds] == pytest.approx([1 + 1 + 1, 1 + 1, 1])
    assert len(_FakeEvent.waited) == (3 if device == "cuda" else 0)  # once per stream, at its total
    assert a.seconds == pytest.approx(3.0) and len(_FakeEvent.waited) == (3 if device == "cuda" else 0)
