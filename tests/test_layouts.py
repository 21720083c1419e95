"""quantwm/core/layouts: every stored span is a typed layout that decodes itself, counts its bytes and gives the
fused kernel its view, built once; nothing outside the layouts tests a span's tensor names; an attend over a
warm cache builds no view and waits on nothing."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

from quantwm.core import selfcheck
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.layouts import Layout, views_built
from quantwm.core.methods import REGISTRY, SpanContext, get_method
from quantwm.core.syncs import HostSyncs

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME_CALLS = {"get", "pop", "setdefault", "startswith", "endswith", "getattr", "hasattr", "removeprefix"}


def _base(name: str) -> str:
    """A component name without its stage digits, stream suffix or half: "codebook0" -> "codebook",
    "psac_codes.3" -> "psac_codes", "k.alloc_codes" -> "alloc_codes", f"codebook{s}" -> "codebook"."""
    name = re.sub(r"\.\d+$", "", name.split("{")[0]).strip(".")
    name = re.sub(r"^[kv]\.", "", name)
    return re.sub(r"^(codebook|centroid_ids)\d+$", r"\1", name)


def _span_names() -> set[str]:
    """Every component name a registered method's layout stores, plus the entries of the side dicts the layouts
    replaced; a name that is also a method's ("bf16") is left out."""
    stats = torch.eye(64).expand(2, 64, 64) + 0.1
    x = torch.randn(2, 128, 64, generator=torch.Generator().manual_seed(1))
    names = {"full", "center", "alloc_meta", "alloc_codes", "psac", "centroids", "codebook", "ids"}
    for name in REGISTRY:
        for kind in "kv":
            options = {"psac_energy": 0.9} if name == "quantwm" else {}
            enc = get_method(name, **options).encode(x, kind, SpanContext(stats=stats, history=10))
            names |= {_base(n) for n in {**enc.components(), **enc.shared()}}
    return names - set(REGISTRY)  # "bf16" names a method too


def _offences(text: str, names: set[str]) -> list[str]:
    """Lines that test a string naming a span tensor: compared (`in`, `==`), used as a subscript, or passed to
    get/pop/setdefault/startswith/endswith/getattr (read from the AST: any spelling of the expression counts)."""
    found = []

    def named(node) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return _base(node.value) in names
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            return _base(str(node.values[0].value)) in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    for node in ast.walk(ast.parse(text)):
        parts = []
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Subscript):
            parts = [node.slice]
        elif isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            parts = node.args if called in NAME_CALLS else []
        if any(named(p) for p in parts):
            found.append(f"{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


def _code_files():
    yield ROOT / "app.py"
    for top in ("quantwm", "kernels", "app", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "layouts" not in path.relative_to(ROOT).parts:
                yield path


def test_nothing_outside_the_layouts_tests_a_spans_tensor_names():
    names = _span_names()
    found = {str(p.relative_to(ROOT)): o for p in _code_files() if (o := _offences(p.read_text(), names))}
    assert not found, found


def test_the_name_check_sees_the_old_ways():
    names = _span_names()
    assert {"codes", "scales", "zeros", "codebook", "centroid_ids", "alloc_bits", "psac_basis", "psac_codes"} <= names
    for old in ('if "alloc_codes" in side: pass', 'codes = side["codes"]', 'x = enc.tensors["scales"]',
                'zero = side.get("zeros")', 'c = t[f"codebook{s}"]', 'n = sum(1 for k in t if ".centroids" in k)',
                'b = by_component["k.alloc_codes"]', 'f = name.endswith(".full")', 'p = side.pop("psac", None)',
                'ok = name == "codes" or key in ("codes", "scales")', 'c = getattr(side, "codebook")',
                'r = enc.components()["psac_codes.0"]'):
        assert _offences(old, names), old
    assert not _offences("out = layout.decode()\nname = 'codes_of_something'\nd = {'codes': 1}", names)


SPAN = torch.randn(2, 97, 64, generator=torch.Generator().manual_seed(0)) * 2 + 0.5


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("kind", ["k", "v"])
def test_every_stored_span_decodes_itself_and_counts_its_bytes(name, kind):
    stats = torch.eye(64).expand(2, 64, 64) + 0.1
    enc = get_method(name).encode(SPAN, kind, SpanContext(stats=stats, history=10))
    assert isinstance(enc, Layout) and enc.shape == tuple(SPAN.shape)
    x = enc.decode()  # no method asked
    assert x.shape == SPAN.shape and x.dtype == torch.float32 and torch.isfinite(x).all()
    assert ((x - SPAN).norm() / SPAN.norm()) < 0.6
    parts = {**enc.components(), **enc.shared()}
    assert enc.nbytes() == sum(t.numel() * t.element_size() for t in parts.values())
    assert enc.bytes_by_component() == {k: t.numel() * t.element_size() for k, t in parts.items()}
    step = enc.step()
    assert step is None or (step.shape == SPAN.shape and (step >= 0).all())
    side = enc.kernel_side
    assert side is None or side.n_tokens == 97
    assert enc.describe()


@pytest.mark.parametrize("method, budget, lowp", [("quantwm", 2.5, None), ("kivi", None, None), ("qvg", None, None),
                                                 ("quantwm", None, None), ("quantwm+jensen", None, None),
                                                 ("quantwm", 2.5, "int8"), ("quantwm", 2.5, "e4m3"), ("kivi", None, "e4m3")])
def test_warm_attends_make_no_host_sync_and_build_no_kernel_view(method, budget, lowp, monkeypatch):
    """20 denoising passes over a warm cache on the fused path make no host sync and build no kernel view: each
    quantized span's view was built at its commit and is the very object the launcher receives. The real launcher
    runs; after the warm-up (whose first uses run the self-check) the compiled kernel's launch is replaced by a
    recorder (the interpreter's own work is not ours)."""
    from quantwm.kernels import span_attention as sa

    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    launched, launcher = [], sa.span_attention

    def recorded(q, acc, m, l, k, v, *args, **kwargs):
        launched.append((k, v))
        return launcher(q, acc, m, l, k, v, *args, **kwargs)

    monkeypatch.setattr(sa, "span_attention", recorded)
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    cache = KVCache(CacheConfig(method, budget=budget, check_inputs=False, lowp=lowp), 1)
    # chunks 1 and 2 quantized between the BF16 sink and the recent chunk. The allocator (a budget) is slow under
    # the interpreter: one head of 32 tokens x 32 channels; the fixed formats' groups of 64 channels need 64
    H, N, D = (1, 32, 32) if budget else (2, 64, 64)
    g = torch.Generator().manual_seed(0)
    for i in range(4):  # the real kernel, checked against its reference on first use of each layout
        q, k, v = (torch.randn(1, H, N, D, generator=g) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=True)
    assert selfcheck.verdicts() and not selfcheck.fallbacks()
    grids = []
    monkeypatch.setattr(sa, "_span_attention_kernel", type("Launch", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or (lambda *a, **kw: None)})())
    quantized = [c for c in cache.spans(0) if c.quantized]
    assert len(quantized) == 2 and all(c.k_enc.kernel_side is not None for c in quantized)
    q, k, v = (torch.randn(1, H, N, D, generator=g) for _ in range(3))
    built, launched[:], grids[:] = views_built(), [], []
    with HostSyncs() as counter:
        for _ in range(20):
            cache.attend(0, q, k, v, chunk=4)
    assert counter.calls == [] and views_built() == built
    assert len(launched) == len(grids) == 20 * len(cache.spans(0))
    sides = {id(c.k_enc.kernel_side) for c in quantized} | {id(c.v_enc.kernel_side) for c in quantized}
    assert sides <= {id(s) for pair in launched for s in pair}


def test_the_sync_counter_sees_a_sync():
    x = torch.ones(3)
    with HostSyncs() as counter:
        bool(x.any()), x.tolist(), torch.tensor([1, 2])
    assert counter.calls == ["__bool__", "tolist", "tensor"]
