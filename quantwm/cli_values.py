"""The command line's flag values: the text of `--methods`, `--set`, `--budget`, integer and bits lists turned into
values (a bad one raises ValueError naming the flag), and the world model `--weights` names."""
from __future__ import annotations

from .core.methods import known_methods, parse_method_name


def method_list(text: str) -> list[str]:
    """--methods' comma-separated registry names, each checked (`quantwm methods` lists them)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise ValueError("--methods is empty; known methods: " + ", ".join(known_methods()))
    for m in names:
        parse_method_name(m)
    return names


def set_options(pairs: list[str]) -> tuple:
    """['lam=4', 'psac=false'] -> (('lam', 4.0), ('psac', False)) for CacheConfig.method_options."""
    out = []
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        low = raw.lower()
        value = {"true": True, "false": False, "none": None}.get(low, raw)
        if isinstance(value, str):
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    pass
        out.append((key, value))
    return tuple(out)


def budget_pair(a) -> tuple:
    """(Keys' budget, Values' budget): --budget-k / --budget-v, else --budget (None: no budget)."""
    return (a.budget_k if a.budget_k is not None else a.budget, a.budget_v if a.budget_v is not None else a.budget)


def int_list(text: str, what: str) -> list[int]:
    """Comma-separated integers of flag `what`."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def bits_list(text: str, what: str) -> list[float]:
    """Comma-separated bits per element of flag `what`, each in (0, 16]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    bad = [v for v in values if not 0 < v <= 16]
    if bad or not values:
        raise ValueError(f"{what} takes bits per element in (0, 16], got {text!r}")
    return values


def world_model(weights: str | None):
    """The built-in world model from --weights (default: the weights shipped with the package)."""
    from .world.generate import DEFAULT_WEIGHTS, load_world_model

    return load_world_model(weights or DEFAULT_WEIGHTS)

