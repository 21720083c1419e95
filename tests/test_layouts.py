"""quantwm/core/layouts: every stored span is a typed layout that decodes itself, counts its bytes and gives the
fused kernel its view, built once; nothing outside the layouts tests a span's tensor names; an attend over a
warm cache builds no view and waits on nothing."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.layouts import Layout, views_built
from quantwm.core.methods import REGISTRY, SpanContext, get_method
from quantwm.core.syncs import HostSyncs

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the names of stored span tensors and of the old side dicts' entries (generic words such as "bits" are left out:
# plain dicts of the app and the reports use them)
NAMES = r"(alloc_\w*|codes|scales|zeros|codebook\d*|centroid_ids\d*|ids|full|psac_\w*|center|block_scales|" \
        r"tensor_scales)"
TESTS_OF_NAMES = [
    re.compile(r"""["']\.?""" + NAMES + r"""(\.\{?\w*\}?)?["']\s+(not\s+)?in\b"""),  # "codes" in side
    re.compile(r"""\b\w+\s*\[\s*f?["']""" + NAMES + r"""["'\.{]"""),  # side["codes"], t[f"codebook{s}"]
    re.compile(r"\.(tensors|shared)\s*\["),  # enc.tensors[...]
    re.compile(r"""\.get\(\s*["']""" + NAMES + r"""["']"""),  # side.get("zeros")
]


def _code_files():
    for top in ("quantwm", "kernels", "app", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "layouts" not in path.relative_to(ROOT).parts:
                yield path


def _offences(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if any(p.search(line) for p in TESTS_OF_NAMES)]


def test_nothing_outside_the_layouts_tests_a_spans_tensor_names():
    found = {str(p.relative_to(ROOT)): o for p in _code_files() if (o := _offences(p.read_text()))}
    assert not found, found


def test_the_name_check_sees_the_old_ways():
    assert _offences('if "alloc_codes" in side:')
    assert _offences('codes = side["codes"]')
    assert _offences('x = enc.tensors["scales"]')
    assert _offences('zero = side.get("zeros")')
    assert _offences('c = t[f"codebook{s}"]')
    assert not _offences('out = layout.decode()')


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
    runs; only the compiled kernel's launch is replaced by a recorder (the interpreter's own work is not ours)."""
    from quantwm.kernels import span_attention as sa

    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    launched, launcher = [], sa.span_attention

    def recorded(q, acc, m, l, k, v, *args, **kwargs):
        launched.append((k, v))
        return launcher(q, acc, m, l, k, v, *args, **kwargs)

    monkeypatch.setattr(sa, "span_attention", recorded)
    grids = []
    monkeypatch.setattr(sa, "_span_attention_kernel", type("Launch", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or (lambda *a, **kw: None)})())
    cache = KVCache(CacheConfig(method, budget=budget, check_inputs=False, lowp=lowp), 1)
    g = torch.Generator().manual_seed(0)
    for i in range(5):
        q, k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(3))
        cache.attend(0, q, k, v, chunk=i, commit=True)
    quantized = [c for c in cache.spans(0) if c.quantized]
    assert quantized and all(c.k_enc.kernel_side is not None for c in quantized)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(3))
    built, launched[:], grids[:] = views_built(), [], []
    with HostSyncs() as counter:
        for _ in range(20):
            cache.attend(0, q, k, v, chunk=5)
    assert counter.calls == [] and views_built() == built
    assert len(launched) == len(grids) == 20 * len(cache.spans(0))
    sides = {id(c.k_enc.kernel_side) for c in quantized} | {id(c.v_enc.kernel_side) for c in quantized}
    assert sides <= {id(s) for pair in launched for s in pair}


def test_the_sync_counter_sees_a_sync():
    x = torch.ones(3)
    with HostSyncs() as counter:
        bool(x.any()), x.tolist(), torch.tensor([1, 2])
    assert counter.calls == ["__bool__", "tolist", "tensor"]
