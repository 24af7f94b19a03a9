"""The registry of positional schemes from Python (posenc/registry.hpp): the listing, one head
group's scheme as the attention op takes it, and the modules that carry any registered scheme and
its learned parameters by name."""
import json

import torch

from ._checks import _finite, _int, _number, _object, _ops, _positions


@torch.compiler.assume_constant_result  # the registry is fixed when the library loads
def schemes():
    """The registered positional schemes (posenc/registry.hpp), as a list of dicts: ``name``,
    ``aliases`` (other names every call accepts, as forgetting's fox), ``family`` (none, transform,
    relative-bias, bias, relative-terms, sink, token-term, term, normaliser), ``summary``,
    ``source``, ``parameters`` (the learned parameters, "" if none), ``options`` (``name``,
    ``default``, ``integer``, ``description``), ``inputs`` (per-token activations the
    scheme reads: ``name``, ``description``, ``typical`` [min, max] of a trained model's values) and
    ``causal_only`` and ``parameters_fixed`` (the learned parameters are constants of the
    definition: ALiBi's slopes). A name without inputs whose parameters are none or fixed works as
    ``posenc.attention(..., scheme=name)``; every one as ``posenc.Scheme(name, heads, head_dim,
    **options, **{input: tensor})``."""
    return json.loads(_ops.schemes())


# The module posenc.nn.SelfAttention builds for a registered name, where a scheme has its own
# module class: each class registers itself (_attention_module), so nn.py names no scheme.
_ATTENTION_MODULES = {}


def _attention_module(name, build):
    """Class decorator: SelfAttention(scheme=name) builds ``build(cls, heads, head_dim)``."""
    def register(cls):
        # The same class again (importlib.reload) replaces its entry; another class is a mistake.
        known = _ATTENTION_MODULES.get(name)
        if known is not None and known.cls.__qualname__ != cls.__qualname__:
            raise RuntimeError(f"posenc: scheme {name!r} has two modules, {known.cls.__qualname__} and "
                               f"{cls.__qualname__}")

        def make(heads, head_dim):
            return build(cls, heads, head_dim)
        make.cls = cls
        _ATTENTION_MODULES[name] = make
        return cls
    return register


def _scheme_entry(name):
    for entry in schemes():
        if name == entry["name"] or name in entry["aliases"]:
            return entry
    raise ValueError(f"scheme = {name!r}; expected one of " + ", ".join(e["name"] for e in schemes()))


def _scheme(name, heads, options=None, rope_args=None):
    """One head group's registered scheme as the ops take it: a ``torch.classes.posenc.Scheme``
    (posenc/torch/classes.hpp) whose options are numbers (flags 0 or 1)."""
    return _object(_scheme_spec(name, heads, options, rope_args))


def _scheme_spec(name, heads, options=None, rope_args=None):
    """What ``_scheme`` builds, as plain values (``_object`` makes it): the attention passes these
    through torch.compile's graphs as constants."""
    values = {}
    for key, value in (options or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"{name}: option name {key!r} is {type(key).__name__}; expected a str")
        values[key] = float(value) if isinstance(value, bool) else _number(name, key, value)
    _finite("scheme", values)
    return "Scheme", (name, _int(name, "heads", heads), values, None), rope_args


@torch.compiler.allow_in_graph
def _score_bias_op(spec, params, q_positions, k_positions, dtype, head_dim=1):
    """The score_bias op with the Scheme made here from its spec (as ``posenc._functional._rope_op``)."""
    return _ops.score_bias(_object(spec), params, q_positions, k_positions, dtype, head_dim)


class Scheme(torch.nn.Module):
    """Any registered scheme (``posenc.schemes()``) by name, with its options as keyword arguments,
    as an attention scheme: ``posenc.attention(q, k, v, posenc.Scheme("fire", 8, 64, hidden=32))``.
    Its learned parameters, if it has any, are the Parameter ``parameters_``, one flat tensor in
    the registry's parameter shape and order, initialised as the registry does; ``head_dim`` is q's
    head size, which some schemes' shapes depend on (Shaw, Transformer-XL, TUPE). A scheme's
    per-token inputs (``posenc.schemes()``' ``inputs``, activations such as forgetting's
    ``log_fgate`` [B, Sk, heads]) are keyword arguments too, tensors that the attention's backward
    reaches: ``posenc.Scheme("forgetting", 8, 64, log_fgate=F.logsigmoid(x @ w_f + b_f))``. A scheme
    registered in C++ is so usable from Python with no module of its own."""

    _shape_takes_head_dim = True

    def __init__(self, name, heads, head_dim, **options):
        super().__init__()
        self.entry = _scheme_entry(name)
        # The declared inputs are tensors, kept apart from the numeric options.
        self.inputs = {}
        for spec in self.entry.get("inputs", []):
            if spec["name"] not in options:
                raise ValueError(f"Scheme: {name} reads the per-token input {spec['name']} ({spec['description']}); "
                                 f"expected {spec['name']}=<tensor>")
            value = options.pop(spec["name"])
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"Scheme: {name}'s {spec['name']} is {type(value).__name__}; expected a torch.Tensor")
            if not value.is_floating_point():
                raise TypeError(f"Scheme: {name}'s {spec['name']} dtype {value.dtype}; expected a floating dtype")
            self.inputs[spec["name"]] = value
        for key, value in options.items():
            if isinstance(value, torch.Tensor):
                declared = ", ".join(i["name"] for i in self.entry.get("inputs", [])) or "none"
                raise ValueError(f"Scheme: {key} is a tensor, but {name} reads no per-token input {key} (its "
                                 f"inputs: {declared}); expected a number")
        # The registry's own name (an alias, fox, becomes forgetting).
        self.name, self.heads, self.options = self.entry["name"], _int(name, "heads", heads, 1), dict(options)
        self.head_dim = _int(name, "head_dim", head_dim, 1)
        initial = self._scheme().initial_parameters(self.head_dim)
        self.parameters_ = torch.nn.Parameter(initial.to(torch.float32)) if initial.numel() > 0 else None

    def _scheme(self):
        return _scheme(self.name, self.heads, self.options)

    def _parameter_tensor(self):
        return self.parameters_ if self.parameters_ is not None else torch.empty(0, dtype=torch.float64)

    def _attention_scheme(self, heads, keys_rotated, head_dim):
        # The call's keys_rotated (k: a cache of keys already rotated) reaches the schemes that rotate
        # keys; the others, in a call with head groups, have nothing to rotate.
        options = self.options
        if keys_rotated and any(o["name"] == "keys_rotated" for o in self.entry["options"]):
            options = {**options, "keys_rotated": True}
        if self.heads != heads:
            raise ValueError(f"attention: {self.name} has heads = {self.heads}; expected the group's {heads}")
        if self._shape_takes_head_dim and self.head_dim != head_dim:
            raise ValueError(f"attention: {self.name} has head_dim = {self.head_dim}; expected q's {head_dim}")
        return _scheme_spec(self.name, self.heads, options), self._parameter_tensor()

    def bias(self, q_positions, k_positions=None, dtype=None):
        """A scheme of the relative-bias or bias family (``posenc.schemes()``) materialised: its
        biases [B, H, Sq, Sk] (B = 1 for [S] positions) in ``dtype`` (default: the
        parameters', else float32), computed in fp64 and differentiable in ``parameters_``."""
        if self.entry["family"] not in ("relative-bias", "bias"):
            raise ValueError(f"Scheme.bias: {self.name} is a {self.entry['family']} scheme; expected one of the "
                             "relative-bias or bias family: " + ", ".join(
                                 e["name"] for e in schemes() if e["family"] in ("relative-bias", "bias")))
        k_positions = q_positions if k_positions is None else k_positions
        if dtype is None:
            dtype = self.parameters_.dtype if self.parameters_ is not None else torch.float32
        return _score_bias_op(_scheme_spec(self.name, self.heads, self.options), self.parameters_,
                              _positions(q_positions, 0), _positions(k_positions, 0), dtype, self.head_dim)

    def _attention_input(self):
        """The per-token tensor the op passes for this group (its ``gates`` entry), or None."""
        return next(iter(self.inputs.values()), None)

    def extra_repr(self):
        options = "".join(f", {k}={v}" for k, v in self.options.items())
        options += "".join(f", {k}=<{tuple(v.shape)}>" for k, v in self.inputs.items())
        head_dim = f", head_dim={self.head_dim}" if self._shape_takes_head_dim else ""
        return f"{self.name!r}, heads={self.heads}{head_dim}{options}"


class RelativeBias(Scheme):
    """Any registered scheme of the relative-bias family (b_h(k − q) added to the scores; see
    ``posenc.schemes()``) by name, with its options as keyword arguments. ``forward(q_positions,
    k_positions)`` gives the biases [B, H, Sq, Sk]; as an attention scheme it runs inside the fused
    kernel. Learned parameters, if the scheme has any, are the Parameter ``parameters`` in the
    registry's shape, initialised as the registry does."""

    def __init__(self, name, heads, **options):
        entry = _scheme_entry(name)
        if entry["family"] != "relative-bias":
            raise ValueError(f"RelativeBias: name = {name!r} is a {entry['family']} scheme; expected one of the "
                             "relative-bias family: " + ", ".join(e["name"] for e in schemes()
                                                                  if e["family"] == "relative-bias"))
        super().__init__(name, heads, 1, **options)

    # A bias of k − q alone: its parameters do not depend on the head size.
    _shape_takes_head_dim = False

    def forward(self, q_positions, k_positions=None, dtype=None):
        """[B, H, Sq, Sk] biases in ``dtype`` (default: the parameters', else float32), computed in fp64."""
        return self.bias(q_positions, k_positions, dtype)


@_attention_module("sandwich", lambda cls, heads, head_dim: cls(heads))
class Sandwich(RelativeBias):
    """Sandwich (Chi et al. 2023): the parameter-free bias (Σ_k cos(r·ω_k) − d'/2)·H/(8(h + 1)),
    ω_k = base^(−2k/d'), r = key − query (posenc/sandwich.hpp)."""

    def __init__(self, heads, dim=128, base=10000.0):
        super().__init__("sandwich", heads, dim=int(dim), base=float(base))
