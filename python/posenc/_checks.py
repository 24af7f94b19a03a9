"""The checks that every front end applies to its arguments, and the ops' loading: the library
next to this file, refused in one line when it was built for another torch."""
import math
import numbers
import os

import torch


def _load():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libposenc_torch.so")
    if not os.path.exists(path):
        raise ImportError(f"posenc: {path} is missing; build with -DPOSENC_BUILD_TORCH=ON (both set-up commands do)")
    # The extension's C++ ABI is that of the torch it was built against: another major.minor would
    # abort the interpreter when the library loads, so it is refused here, in one line.
    from ._build import TORCH_VERSION
    built, running = TORCH_VERSION.split(".")[:2], torch.__version__.split("+")[0].split(".")[:2]
    if built != running:
        raise ImportError(f"posenc: built for torch {TORCH_VERSION}, but this interpreter has torch {torch.__version__}; "
                          f"install torch=={'.'.join(built)}.* or rebuild posenc against this torch")
    torch.ops.load_library(path)


def _finite(name, value):
    """value, after checking that every number in it (in dicts and lists too) is finite: the message
    names the entry."""
    def check(path, x):
        # While torch.compile traces, a module's floats may be symbolic (dynamic=True); they were
        # checked when the module was made, and the library checks them again.
        if isinstance(x, float) and not torch.compiler.is_compiling() and not math.isfinite(x):
            raise ValueError(f"{path} = {x}; expected a finite number")
        if isinstance(x, dict):
            for k, v in x.items():
                check(f"{path}[{k!r}]", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                check(f"{path}[{i}]", v)
    check(name, value)
    return value


def _int(where, name, value, minimum=None):
    """value as an int, refusing bools, floats (no silent truncation) and other types by name."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} is {type(value).__name__}; expected an int")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {name} = {value}; expected an int >= {minimum}")
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{where}: {name} = {value}; expected an int in [-2^63, 2^63)")
    return int(value)


def _number(where, name, value):
    """value as a float, refusing bools, strings and None by name."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} is {type(value).__name__}; expected a number")
    return float(value)


def _flag(where, name, value):
    """value as a bool: only True or False (a string such as 'no' would otherwise count as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} is {type(value).__name__}; expected True or False")
    return value


_load()


from . import _fake  # noqa: E402,F401  the ops' fake kernels (torch.compile, opcheck)


_ops = torch.ops.posenc


_EMPTY = torch.empty(0, dtype=torch.float64)  # the parameter tensor of a scheme without any


def _positions(positions, length, device_like=None):
    if positions is None:
        return torch.arange(length, dtype=torch.long)
    if not isinstance(positions, torch.Tensor):
        positions = torch.as_tensor(positions, dtype=torch.long)
    return positions


def _concrete(x):
    """x with symbolic numbers (torch.compile's dynamic=True traces a module's ints and floats as
    symbols) made plain: the objects are built from the values the graph is specialised on."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        return int(x) if isinstance(x, torch.SymInt) else float(x)
    if isinstance(x, dict):
        return {k: _concrete(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_concrete(v) for v in x)
    return x


def _object(spec):
    """A typed argument of the ops (torch.classes.posenc.Rope, Scheme or Temperature) from its spec
    (kind, constructor arguments, and for a Scheme its Rope's arguments or None)."""
    kind, args, rope_args = _concrete(spec)
    if rope_args is not None:
        args = (*args[:-1], torch.classes.posenc.Rope(*rope_args))
    return getattr(torch.classes.posenc, kind)(*args)


def _non_finite_key(value, path=""):
    """The path (``['rope_scaling']['factor']``) and value of the first non-finite float in a
    config's dicts and lists, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _non_finite_key(item, f"{path}[{key!r}]")
        if found is not None:
            return found
    return None


def _pair_positions(q_positions, k_positions):
    return q_positions, (q_positions if k_positions is None else k_positions)


def _unset(value, unset):
    if unset is None:
        return value is None
    if isinstance(value, torch.Tensor):
        return False
    return value == unset


def _cu_seqlens(cu_seqlens, where="attention"):
    """cu_seqlens as the op's (cu_q, cu_k) lists of ints ([] and []: not packed). One sequence (a
    1-D integer tensor, or a list or tuple of ints) serves queries and keys; a pair ``(cu_q, cu_k)``
    is a tuple of two sequences. Given, each holds at least [0, T]: an empty one is not "unset"."""
    if cu_seqlens is None:
        return [], []

    def is_sequence(x):
        return isinstance(x, (list, tuple)) or (isinstance(x, torch.Tensor) and x.dim() == 1)

    def entry(x):  # an int, or a 0-dim integer tensor (as tuple(tensor) gives them)
        if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_floating_point() and not x.is_complex():
            return x.item()
        return x

    if isinstance(cu_seqlens, tuple) and cu_seqlens and all(is_sequence(x) for x in cu_seqlens):
        if len(cu_seqlens) != 2:
            raise TypeError(f"{where}: cu_seqlens is a tuple of {len(cu_seqlens)} sequences; expected one sequence "
                            "of ints or a pair (cu_q, cu_k)")
        pair = cu_seqlens
    else:
        pair = (cu_seqlens, cu_seqlens)
    lists = []
    for name, cu in zip(("cu_seqlens_q", "cu_seqlens_k") if pair[0] is not pair[1] else ("cu_seqlens",) * 2, pair):
        if isinstance(cu, torch.Tensor):
            if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
                raise TypeError(f"{where}: {name} is a {cu.dtype} tensor of shape {tuple(cu.shape)}; expected a 1-D "
                                "integer tensor")
            cu = cu.tolist()
        if not isinstance(cu, (list, tuple)):
            raise TypeError(f"{where}: {name} is {type(cu).__name__}; expected a 1-D integer tensor, a list or a "
                            "tuple of ints")
        if len(cu) < 2:
            raise ValueError(f"{where}: len({name}) = {len(cu)}; expected at least 2 ([0, ..., T], the "
                             "cumulative sequence lengths), or cu_seqlens=None for unpacked [B, S, H, D] tensors")
        lists.append([_int(where, f"{name}[{i}]", entry(x)) for i, x in enumerate(cu)])
    return lists[0], lists[1]
