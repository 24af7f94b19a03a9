"""A Python fuzzer of posenc's public surfaces (docs/fuzzing.md): property-based calls of
``posenc.attention`` and of the Hugging Face config reader, drawn by hypothesis and shrunk to a
minimal failing case, each checked against the library's contract:

- a call either returns, or raises ValueError or TypeError whose message names the function —
  never another exception, a crash or a hang;
- what returns has the documented shape and dtype, is finite where its inputs are, and equals the
  same call on fp64 inputs (the fp64 reference) within the dtype's rounding, gradients too;
- a call refused for one dtype is refused for fp64 as well, except a multiplier past f32's range.

The seeds (``fuzz_seeds/*.json``, cases in the generators' own format, each with the reason it is
kept and its expected outcome) run first, every time: one per reliability finding and one per
feature. ``POSENC_FUZZ_EXAMPLES`` sets how many new cases each
property draws (500 by default, as the test command runs it, and a quarter of that for posenc.flex;
0 replays the seeds alone).
Run: PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python -m pytest -q python/tests/fuzz_api.py
"""
import json
import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis.errors import InvalidArgument
from hypothesis import strategies as st

import posenc
import posenc.flex

SEEDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_seeds")
EXAMPLES = int(os.environ.get("POSENC_FUZZ_EXAMPLES", "500"))
# Under CI (CI=true) the cases are drawn from a fixed seed, so that a submission's run is
# reproducible and no landing waits on the draw; elsewhere every run draws new ones.
FUZZ = settings(max_examples=max(EXAMPLES, 1), deadline=None, database=None, print_blob=True,
                derandomize=os.environ.get("CI") == "true", suppress_health_check=list(HealthCheck))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Output tolerance relative to max|v| (a convex combination of v's rows): f32's math rounds each
# product and sum to 2^-24, and the outputs of 16-bit calls are rounded once more, to 2^-8 (bf16)
# or 2^-11 (f16); the factors allow the sums over up to 12 keys. The scores' own rounding is added
# by score_error: a logit off by δ moves the output by at most about δ·max|v|.
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 3e-3}
# Every registered scheme by name (posenc.schemes()), then three forms the registry does not list:
# RoPE under YaRN's scaling, ALiBi's module, and two head groups.
ENTRIES = {e["name"]: e for e in posenc.schemes()}
SCHEMES = [None] + list(ENTRIES) + ["rope-yarn", "alibi-module", "groups"]


def load_seeds(name):
    with open(os.path.join(SEEDS, name)) as f:
        return json.load(f)


def tally(text):
    """Counts a kind of case for --hypothesis-show-statistics (a seed's replay counts nothing)."""
    try:
        event(text)
    except InvalidArgument:
        pass


def refused(error):
    """A refusal as the contract has it: ValueError or TypeError of one line that names the
    function and the parameter ("where: name = value; expected …")."""
    text = str(error)
    return isinstance(error, (ValueError, TypeError)) and "\n" not in text and re.match(r"[\w.]+: \S", text) is not None


# ─── posenc.attention ──────────────────────────────────────────────────────────────────────────

ATTENTION_FIELDS = {
    "seed": st.integers(0, 2**31 - 1),
    "batch": st.integers(0, 2),
    "sq": st.integers(0, 9),
    "sk": st.integers(0, 12),
    "kv_heads": st.integers(1, 2),
    "group": st.integers(1, 3),
    "dim": st.sampled_from([1, 2, 3, 4, 6, 8, 16, 20]),
    "dim_v": st.one_of(st.none(), st.none(), st.integers(1, 20)),  # above dim: refused
    "dtype": st.sampled_from(sorted(DTYPES)),
    "scheme": st.sampled_from(SCHEMES),
    "causal": st.booleans(),
    "window": st.tuples(st.sampled_from([-1, -1, -1, 0, 1, 3, -2]), st.sampled_from([-1, -1, -1, 0, 0, 2])),
    "chunk_size": st.sampled_from([None, None, None, 1, 2, 3, 5, 0]),
    "temperature": st.one_of(st.none(), st.tuples(st.sampled_from([1.0, 2.0, 4.0]), st.floats(0.0, 2.0))),
    "softcap": st.sampled_from([0.0, 0.0, 0.5, 5.0, 50.0]),
    "scale": st.one_of(st.none(), st.floats(0.01, 10.0)),
    "layout": st.sampled_from(["bshd", "bshd", "bshd", "bhsd"]),
    "positions": st.sampled_from([None, None, "shifted", "random"]),
    "keys_rotated": st.booleans(),
    "return_lse": st.booleans(),
    "skip": st.booleans(),
    "sinks": st.booleans(),
    "packed": st.one_of(st.none(), st.none(), st.none(), st.lists(st.integers(0, 5), min_size=1, max_size=4),
                        st.lists(st.integers(0, 5), min_size=1, max_size=4), st.just([])),
    "cu_form": st.sampled_from(["tensor", "list", "tuple", "pair"]),
    "grad": st.booleans(),
    "magnitude": st.sampled_from([0.1, 1.0, 4.0, 30.0]),
}
attention_cases = st.fixed_dictionaries(ATTENTION_FIELDS)


def scheme_of(name, heads, group, dim, gate):
    entry = ENTRIES.get(name)
    if entry is not None and (entry["inputs"] or (entry["parameters"] and not entry["parameters_fixed"])):
        # The registry's module, its parameters seeded (fp64: the reference casts them), a gate for
        # each per-token input.
        return posenc.Scheme(name, heads, dim, **{i["name"]: gate for i in entry["inputs"]})
    if name == "rope-yarn":
        return posenc.RotaryPositionalEncoding(dim, scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 4},
                                               max_position_embeddings=16)
    if name == "alibi-module":
        return posenc.ALiBi(heads)
    if name == "groups":  # the first KV group's heads on RoPE, the rest on ALiBi
        return [(group, "rope"), (heads - group, "alibi")] if heads > group else [(heads, "rope")]
    return name


def option_names(name):
    return {o["name"] for o in ENTRIES[name]["options"]} if name in ENTRIES else set()


def attention_inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    heads, kv = case["kv_heads"] * case["group"], case["kv_heads"]
    dim, dim_v = case["dim"], case["dim_v"] or case["dim"]
    m = case["magnitude"]
    if case["packed"] is not None:
        lengths = case["packed"]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        shape_q, shape_k, shape_v = (cu[-1], heads, dim), (cu[-1], kv, dim), (cu[-1], kv, dim_v)
    else:
        cu = None
        shape_q, shape_k, shape_v = ((case["batch"], case["sq"], heads, dim), (case["batch"], case["sk"], kv, dim),
                                     (case["batch"], case["sk"], kv, dim_v))
    q = m * torch.randn(shape_q, generator=g, dtype=torch.float64)
    k = m * torch.randn(shape_k, generator=g, dtype=torch.float64)
    v = torch.randn(shape_v, generator=g, dtype=torch.float64)
    options = {"causal": case["causal"], "window": tuple(case["window"]), "chunk_size": case["chunk_size"],
               "softcap": case["softcap"], "scale": case["scale"], "return_lse": case["return_lse"],
               "skip_vanishing_tiles": case["skip"], "layout": case["layout"]}
    if case["temperature"] is not None:
        options["temperature"] = posenc.PositionTemperature(kind="llama4", floor_scale=case["temperature"][0],
                                                            attn_scale=case["temperature"][1])
    if case["sinks"]:
        options["sinks"] = torch.randn(heads, generator=g, dtype=torch.float64)
    if case["keys_rotated"] and (case["scheme"] == "rope-yarn" or "keys_rotated" in option_names(case["scheme"])):
        options["keys_rotated"] = True
    if cu is not None:
        form = case["cu_form"]
        options["cu_seqlens"] = (torch.tensor(cu) if form == "tensor" else list(cu) if form == "list" else
                                 tuple(cu) if form == "tuple" else (list(cu), torch.tensor(cu)))
    elif case["positions"] is not None:
        sq, sk = case["sq"], case["sk"]
        if case["positions"] == "shifted":  # a cache's offset: the defaults moved by 1000
            options["q_positions"] = torch.arange(sk - sq, sk) + 1000 if sk >= sq else torch.arange(sq) + 1000
            options["k_positions"] = torch.arange(sk) + 1000
        else:
            options["q_positions"] = torch.randint(0, 50, (sq,), generator=g)
            options["k_positions"] = torch.randint(0, 50, (sk,), generator=g).sort().values
    gate = torch.nn.functional.logsigmoid(torch.randn(*shape_k[:-2], heads, generator=g, dtype=torch.float64) + 2)
    if case["layout"] == "bhsd" and cu is None:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return q, k, v, scheme_of(case["scheme"], heads, case["group"], dim, gate), options


def run_attention(q, k, v, scheme, options, dtype, grad):
    def cast(x):
        return x.to(dtype).detach().requires_grad_(grad and x.is_floating_point())

    q, k, v = cast(q), cast(k), cast(v)
    opts = dict(options)
    if "sinks" in opts:
        opts["sinks"] = opts["sinks"].to(torch.float32 if dtype != torch.float64 else dtype)
    result = posenc.attention(q, k, v, scheme, **opts)
    out, lse = result if options["return_lse"] else (result, None)
    grads = None
    if grad and out.numel():
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
        (out.double() * weights).sum().backward()
        grads = [x.grad for x in (q, k, v)]
    return out, lse, grads


def largest_score(case, q, k):
    """A bound on |score|: scale · s(p) · max|q| · max|k| · D (positions below 1100 + 51)."""
    if not q.numel() or not k.numel():
        return 0.0
    factor = 1.0
    if case["temperature"] is not None:
        floor_scale, attn_scale = case["temperature"]
        factor = 1 + attn_scale * math.log(math.floor((1100 + 51) / floor_scale) + 1)
    scale = case["scale"] or case["dim"] ** -0.5
    return scale * factor * float(q.abs().max()) * float(k.abs().max()) * case["dim"]


def rounded_scores(case):
    """Whether bf16 scores come from bf16-rounded queries and keys (posenc.bf16_dot_products)."""
    return case["dtype"] == "bfloat16" and posenc.bf16_dot_products()


def score_error(case, q, k):
    """The scores' f32 rounding relative to their size (2^-24 per product and sum, D of them); with
    bf16 dot products, η = 2^-8·1.02·|score| from the rounded queries and keys, which moves the
    softmax weights by factors within e^{±2η} (docs/attention.md, "Native bf16 products")."""
    if rounded_scores(case):
        return math.expm1(min(2 * 2.0**-8 * 1.02 * largest_score(case, q, k), 700.0))
    return 4 * case["dim"] * 2.0**-24 * largest_score(case, q, k)


def check_attention(case):
    q, k, v, scheme, options = attention_inputs(case)
    dtype = DTYPES[case["dtype"]]
    # 16-bit inputs: the reference sees the same rounded values.
    q, k, v = (x.to(dtype).double() for x in (q, k, v))
    grad = case["grad"] and dtype == torch.float32
    try:
        got = run_attention(q, k, v, scheme, options, dtype, grad)
    except Exception as error:  # noqa: BLE001  the contract is about every exception
        assert refused(error), f"{type(error).__name__}: {error}"
        tally(f"refused: {str(error).split(';')[0][:60]}")
        try:
            run_attention(q, k, v, scheme, options, torch.float64, False)
        except Exception as reference_error:  # noqa: BLE001
            assert refused(reference_error), f"{type(reference_error).__name__}: {reference_error}"
            return f"refused: {error}"
        assert "f32's largest" in str(error), f"refused for {case['dtype']} alone: {error}"
        return f"refused for {case['dtype']}: {error}"
    out, lse, grads = got
    want, want_lse, want_grads = run_attention(q, k, v, scheme, options, torch.float64, grad)
    assert out.dtype == dtype and out.shape == want.shape
    assert out.shape[-1] == v.shape[-1] and out.shape[:-1] == q.shape[:-1]
    tally(f"compared: {case['scheme']}" + (" packed" if case["packed"] is not None else ""))
    if largest_score(case, q, k) > 1e37:
        return "overflow"  # scores past f32's range: NaN, as in the eager f32 composition (docs/attention.md)
    assert torch.isfinite(out).all(), "finite inputs gave a non-finite output"
    atol = (TOLERANCE[case["dtype"]] + score_error(case, q, k)) * max(1.0, float(v.abs().max()) if v.numel() else 1.0)
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=0)
    if lse is not None:
        assert lse.shape == want_lse.shape
        # lse ~ the largest score: its f32 rounding is relative to it (|score| <= scale·|q|·|k|, up
        # to 30²·D·10 here) plus the log of up to 12 terms.
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite) or case["dtype"] != "float32"
        moved = 2.0**-8 * 1.02 * largest_score(case, q, k) if rounded_scores(case) else 0.0
        torch.testing.assert_close(lse.double()[finite], want_lse.double()[finite], atol=1e-3 + moved, rtol=1e-4)
    if grads is not None:
        for name, got_grad, want_grad in zip("qkv", grads, want_grads):
            if want_grad is None:
                continue
            assert got_grad is not None, f"no gradient for {name}"
            assert torch.isfinite(got_grad).all(), f"non-finite gradient of {name}"
            # Gradients scale with |q|, |k| and the scale: relative to the reference's largest entry,
            # f32's sums over up to 12 keys and D products, and the scores' rounding (above).
            largest = max(1.0, float(want_grad.abs().max()) if want_grad.numel() else 1.0)
            bound = (1e-4 + 16 * score_error(case, q, k)) * largest
            torch.testing.assert_close(got_grad.double(), want_grad, atol=bound, rtol=0)
    return "ok"


# ─── posenc.flex on the same cases ─────────────────────────────────────────────────────────────

# What posenc.flex refuses that the fused kernel runs (docs/flex.md): schemes with no score function,
# biases over too wide a span of positions or too many of them.
FLEX_LIMITS = ("not supported through FlexAttention", "positions span", "for a position-bias table")
ROUNDING = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def check_flex(case):
    """posenc.flex through torch's eager FlexAttention (no gradients: torch has no CPU backward for
    q, k, v): a call the fused kernel runs in the case's dtype gives the fp64 reference's output
    and lse within check_attention's tolerance, or is refused for one of posenc.flex's limits; a
    call the fused kernel refuses is refused."""
    q, k, v, scheme, options = attention_inputs(case)
    dtype = DTYPES[case["dtype"]]
    q, k, v = (x.to(dtype).double() for x in (q, k, v))
    try:
        want, want_lse, _ = run_attention(q, k, v, scheme, options, dtype, False)
        want, want_lse, _ = run_attention(q, k, v, scheme, options, torch.float64, False)
    except Exception as error:  # noqa: BLE001
        assert refused(error), f"{type(error).__name__}: {error}"
        if "f32's largest" in str(error):
            return f"refused for {case['dtype']}: {error}"  # a multiplier past f32's range: not flex's to judge
        want = None
    opts = dict(options)
    opts.pop("skip_vanishing_tiles")
    if "sinks" in opts:
        opts["sinks"] = opts["sinks"].to(torch.float32)
    try:
        with torch.no_grad():
            got = posenc.flex.attention(q.to(dtype), k.to(dtype), v.to(dtype), scheme, compiled=False, **opts)
    except Exception as error:  # noqa: BLE001  the contract is about every exception
        assert refused(error), f"{type(error).__name__}: {error}"
        assert want is None or any(limit in str(error) for limit in FLEX_LIMITS), \
            f"posenc.flex refused what the fused kernel runs: {error}"
        tally(f"refused: {str(error).split(';')[0][:60]}")
        return f"refused: {error}"
    assert want is not None, "posenc.flex ran a call the fused kernel refuses"
    out, lse = got if options["return_lse"] else (got, None)
    assert out.dtype == dtype and out.shape == want.shape, (out.dtype, out.shape, want.shape)
    tally(f"compared: {case['scheme']}" + (" packed" if case["packed"] is not None else ""))
    if largest_score(case, q, k) > 1e37:
        return "overflow"
    assert torch.isfinite(out).all(), "finite inputs gave a non-finite output"
    # 16-bit q and k are transformed (RoPE, the sinusoid, the temperature) in float32 and rounded back
    # to their dtype for FlexAttention, where the fused kernel keeps them in float32: each score moves
    # by up to two roundings of the dtype (ROUNDING) relative to its size.
    family = ENTRIES.get(case["scheme"], {}).get("family")
    transformed = case["scheme"] in ("rope-yarn", "groups") or family == "transform" or case["temperature"] is not None
    error = score_error(case, q, k) + (2 * ROUNDING[case["dtype"]] * largest_score(case, q, k) if transformed else 0)
    atol = (TOLERANCE[case["dtype"]] + error) * max(1.0, float(v.abs().max()) if v.numel() else 1.0)
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=0)
    if lse is not None:
        assert lse.shape == want_lse.shape, (lse.shape, want_lse.shape)
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite) or case["dtype"] != "float32"
        rounded = 2 * ROUNDING[case["dtype"]] * largest_score(case, q, k) if transformed else 0.0
        torch.testing.assert_close(lse.double()[finite], want_lse.double()[finite], atol=1e-3 + rounded, rtol=1e-4)
    return "ok"


# ─── The Hugging Face config reader ────────────────────────────────────────────────────────────

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64), st.sampled_from([0.0, 1.0, 2.0, 8.0]))
positive = st.one_of(st.floats(0.25, 64.0), floats)
rope_scalings = st.one_of(st.none(), st.fixed_dictionaries({
    "rope_type": st.sampled_from(["linear", "dynamic", "yarn", "longrope", "llama3", "default", "ntk", "bogus"]),
}, optional={
    "factor": positive,
    "original_max_position_embeddings": st.integers(-2, 64),
    "low_freq_factor": positive,
    "high_freq_factor": positive,
    "beta_fast": positive,
    "beta_slow": positive,
    "attention_factor": positive,
    "mscale": positive,
    "mscale_all_dim": positive,
    "short_factor": st.lists(positive, min_size=0, max_size=5),
    "long_factor": st.lists(positive, min_size=0, max_size=5),
    "truncate": st.booleans(),
}))
hf_configs = st.fixed_dictionaries({
    "head_dim": st.sampled_from([2, 4, 6, 8, 8, 12, 0, -2]),
}, optional={
    "rope_theta": st.one_of(st.floats(1.5, 1e7), st.floats(1.5, 1e7), floats),
    "hidden_size": st.integers(-4, 48),
    "num_attention_heads": st.integers(-1, 6),
    "num_hidden_layers": st.integers(-1, 6),
    "max_position_embeddings": st.integers(-1, 8192),
    "partial_rotary_factor": st.one_of(st.floats(0.0, 1.0), floats),
    "rope_scaling": rope_scalings,
    "layer_types": st.lists(st.sampled_from(["full_attention", "sliding_attention", "full_attention", 3]),
                            max_size=6),
    "rope_local_base_freq": st.one_of(st.floats(1.5, 1e5), floats),
    "qk_rope_head_dim": st.integers(-1, 8),
})
hf_cases = st.fixed_dictionaries({
    "config": st.one_of(hf_configs, st.builds(lambda c: {"text_config": c}, hf_configs)),
    "layer": st.one_of(st.none(), st.integers(-2, 8), st.just(2**40)),
    "seed": st.integers(0, 2**31 - 1),
})


def check_hf_config(case):
    try:
        rope = posenc.RotaryPositionalEncoding.from_hf_config(case["config"], layer=case["layer"])
    except Exception as error:  # noqa: BLE001
        assert refused(error), f"{type(error).__name__}: {error}"
        tally(f"refused: {str(error).split(';')[0][:60]}")
        return f"refused: {error}"
    tally("read")
    # What the reader accepts, RoPE runs: finite in f32, equal to fp64 within f32's rounding of
    # each rotated pair, at positions past the trained range.
    g = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(1, 5, 2, rope.head_dim, generator=g, dtype=torch.float64)
    positions = torch.tensor([0, 1, 17, 4095, 70000])
    try:
        want = rope(q, positions=positions)[0]
    except Exception as error:  # noqa: BLE001  a scaling the reader passed may still be out of range here
        assert refused(error), f"{type(error).__name__}: {error}"
        return f"refused by rope: {error}"
    got = rope(q.float(), positions=positions)[0]
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    # A rotation keeps each pair's norm; the attention factor of YaRN or LongRoPE scales it (<= ~10).
    torch.testing.assert_close(got.double(), want, atol=1e-5 * max(1.0, float(want.abs().max())), rtol=0)
    return "ok"


# ─── The properties: their seeds, then new cases ───────────────────────────────────────────────

PROPERTIES = {"attention": (check_attention, attention_cases), "flex": (check_flex, attention_cases),
              "hf_config": (check_hf_config, hf_cases)}


@pytest.mark.parametrize("name, case", [(name, case) for name in PROPERTIES for case in load_seeds(f"{name}.json")],
                         ids=lambda x: x.get("why", "seed")[:40] if isinstance(x, dict) else x)
def test_seeds(name, case):
    # Each seed pins its outcome: "ok", "overflow", or the refusal's message (a regular expression).
    outcome = PROPERTIES[name][0]({k: v for k, v in case.items() if k not in ("why", "expect")})
    assert re.search(case["expect"], outcome), f"{case['why']}: {outcome!r} does not match {case['expect']!r}"


@pytest.mark.skipif(EXAMPLES == 0, reason="POSENC_FUZZ_EXAMPLES=0: the seeds alone")
@pytest.mark.parametrize("name", [name for name in PROPERTIES if name != "flex"])
@FUZZ
@given(data=st.data())
def test_fuzz(name, data):
    check, cases = PROPERTIES[name]
    check(data.draw(cases, label=name))


# A quarter of the examples for posenc.flex: each of its calls traces torch's eager FlexAttention
# (about 50 ms, ten times a fused call), and the cases are the attention property's.
@pytest.mark.skipif(EXAMPLES == 0, reason="POSENC_FUZZ_EXAMPLES=0: the seeds alone")
@settings(FUZZ, max_examples=max(EXAMPLES // 4, 1))
@given(data=st.data())
def test_fuzz_flex(data):
    check, cases = PROPERTIES["flex"]
    check(data.draw(cases, label="flex"))


def test_the_seeds_parse_as_cases():
    # A seed edited by hand must still be a case of the generators' shape, with the reason it is kept.
    kept = {"why", "expect"}
    for case in load_seeds("attention.json") + load_seeds("flex.json"):
        assert set(case) == set(ATTENTION_FIELDS) | kept, sorted(set(case) ^ (set(ATTENTION_FIELDS) | kept))
    for case in load_seeds("hf_config.json"):
        assert set(case) == {"config", "layer", "seed"} | kept, case
