"""quantwm/core/selfcheck.py: a wrong kernel is caught on its first use, falls back to its reference for the rest
of the process and says so; a correct one passes once and is not checked again; the switches turn it off or on
for every call. Kernels run under TRITON_INTERPRET=1 (conftest.py)."""
from __future__ import annotations

import pytest
import torch
from quantwm.kernels import quantize_pack as qp
from quantwm.kernels import span_attention as sa

from quantwm.core import attention, backend, selfcheck
from quantwm.core.cache import CacheConfig, KVCache


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """Every test starts with no verdicts and the kernels on (QUANTWM_KERNELS=triton)."""
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    monkeypatch.delenv("QUANTWM_SELFCHECK", raising=False)


def _run(method: str = "kivi", chunks: int = 4, **config) -> tuple[KVCache, list[torch.Tensor]]:
    cache = KVCache(CacheConfig(method, **config), 1)
    g, outs = torch.Generator().manual_seed(0), []
    for i in range(chunks):
        q, k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(3))
        outs.append(cache.attend(0, q, k, v, chunk=i, commit=True))
    return cache, outs


def _scaled_output(monkeypatch, factor=1.5):
    """span_attention patched to fold a wrong state (its accumulator scaled): a kernel that runs and lies."""
    real, calls = sa.span_attention, []

    def broken(q, acc, m, l, *args, **kwargs):
        calls.append(1)
        real(q, acc, m, l, *args, **kwargs)
        acc.mul_(factor)
    monkeypatch.setattr(sa, "span_attention", broken)
    return calls


def test_a_wrong_attention_kernel_is_caught_on_first_use_and_the_reference_takes_over(monkeypatch):
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    _, want = _run("kivi")
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    calls = _scaled_output(monkeypatch)
    with pytest.warns(selfcheck.QuantWMKernelWarning, match=r"span_attention \[k: .*\] float32 on cpu"):
        cache, got = _run("kivi")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the reference's output, not the kernel's
    failed = selfcheck.fallbacks()
    assert failed and all(v.kernel == "span_attention" and not v.ok and v.kernel_error > v.allowed_error for v in failed)
    assert "reference used" in failed[0].line()
    launched = len(calls)
    _run("kivi")  # the same layouts again: straight to the reference, the kernel never launched
    assert len(calls) == launched
    assert [v.line() for v in failed] == list(cache.memory().kernel_fallbacks)


def test_a_kernel_that_shifts_its_codes_is_caught_and_the_codes_come_from_the_reference(monkeypatch):
    real = qp.quantize_pack
    monkeypatch.setattr(qp, "quantize_pack", lambda *a, **kw: real(*a, **kw) ^ 1)  # flips the lowest code bit
    with pytest.warns(selfcheck.QuantWMKernelWarning, match="quantize_pack"):
        cache, _ = _run("rtn")
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    ref_cache, _ = _run("rtn")
    assert torch.equal(cache.keys(0), ref_cache.keys(0))
    assert [v.kernel for v in selfcheck.fallbacks()] == ["quantize_pack"]


def test_a_correct_kernel_passes_once_and_is_not_checked_again(monkeypatch):
    checks = []
    real = attention.attention_check
    monkeypatch.setattr(attention, "attention_check", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    _run("quantwm")
    first = len(checks)
    assert first >= 1 and all(v.ok and v.checks == 1 for v in selfcheck.verdicts())
    _run("quantwm")
    assert len(checks) == first
    assert {v.kernel for v in selfcheck.verdicts()} >= {"span_attention", "quantize_pack", "unpack_bits"}


def test_always_checks_every_call_and_trust_or_the_config_field_checks_none(monkeypatch):
    monkeypatch.setenv("QUANTWM_SELFCHECK", "always")
    _run("kivi", chunks=3)
    assert max(v.checks for v in selfcheck.verdicts()) > 1
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    calls = _scaled_output(monkeypatch, 1.0)
    _run("kivi", selfcheck=False)
    assert calls and selfcheck.verdicts() == []  # the kernels ran, unchecked
    monkeypatch.setenv("QUANTWM_KERNELS", "trust")  # auto's choice of path (here: the CPU's references), unchecked
    assert selfcheck.mode() is None and not backend.use_kernels(torch.zeros(1))
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    monkeypatch.setenv("QUANTWM_SELFCHECK", "sometimes")
    with pytest.raises(ValueError, match="QUANTWM_SELFCHECK must be one of first, always"):
        selfcheck.mode()


def test_the_selfcheck_command_refuses_bad_shapes_in_one_line(capsys):
    """The command itself runs in the device check's dry run (tests/test_gpu_check.py), which checks its report."""
    from quantwm.cli import main

    assert main(["selfcheck", "--heads", "0"]) == 2
    assert "--heads must be a positive integer, got 0" in capsys.readouterr().err
    assert main(["selfcheck", "--lengths", "a,b"]) == 2
