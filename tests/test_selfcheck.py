"""quantwm/core/selfcheck.py: a wrong kernel is caught on its first use, falls back to its reference for the rest
of the process and says so; a correct one passes once and is not checked again; a new shape class is checked
again, a known one is not; the switches turn it off or on for every call; `quantwm selfcheck` exits 1 naming a
failed kernel. Kernels run under TRITON_INTERPRET=1 (conftest.py)."""
from __future__ import annotations

import pytest
import torch
from quantwm.kernels import kmeans_assign as ka
from quantwm.kernels import pack_bits as pb
from quantwm.kernels import qsac_assign as qa
from quantwm.kernels import quantize_pack as qp
from quantwm.kernels import span_args
from quantwm.kernels import span_attention as sa
from quantwm.kernels import unpack_bits as ub

from quantwm.core import attention, backend, selfcheck
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.quant import unpack_bits_ref


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


def test_the_selfcheck_command_exits_1_and_names_a_kernel_that_failed(monkeypatch, capsys, tmp_path):
    """A quantize_pack that flips a code bit: the report runs to its end, writes its JSON, and the command exits 1
    with one stderr line naming the kernel; all correct, 0. The report is cut to one method's paths and no timing
    (the whole report runs in tests/test_gpu_check.py's dry run): the exit code is what is tested here."""
    from quantwm.cli import main
    from quantwm.evaluation import kernel_report

    monkeypatch.setattr(kernel_report, "PATH_METHODS", ("rtn",))
    monkeypatch.setattr(kernel_report, "time_paths", lambda *a, **kw: [])
    argv = ["selfcheck", "--heads", "1", "--head-dim", "64", "--chunk-tokens", "64", "--json", str(tmp_path / "r.json")]
    real = qp.quantize_pack
    monkeypatch.setattr(qp, "quantize_pack", lambda *a, **kw: real(*a, **kw) ^ 1)
    with pytest.warns(selfcheck.QuantWMKernelWarning):
        assert main(argv) == 1
    out = capsys.readouterr()
    failed = [line for line in out.err.splitlines() if line.startswith("quantwm: kernel self-check failed: ")]
    assert failed and all("quantize_pack [" in line and "FAILED, reference used" in line for line in failed)
    assert len(failed) == len(selfcheck.fallbacks())
    assert (tmp_path / "r.json").is_file() and ", 0 failed" not in out.out
    monkeypatch.setattr(qp, "quantize_pack", real)
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    assert main(argv) == 0
    assert "self-check failed" not in capsys.readouterr().err and selfcheck.verdicts()


def _unpack_args(rows: int) -> tuple:
    """`rows` packed 2-bit rows of 64 codes: unpack_bits' arguments."""
    packed = torch.randint(0, 256, (rows, 16), generator=torch.Generator().manual_seed(rows), dtype=torch.uint8)
    return packed, 2, 64


def _unpack(rows: int, ref=unpack_bits_ref) -> torch.Tensor:
    """unpack_bits through the dispatcher's checked call."""
    return selfcheck.checked_exact("unpack_bits", "2-bit", ref, *_unpack_args(rows))


def test_a_kernel_wrong_only_at_ragged_lengths_is_caught_when_a_ragged_length_first_appears(monkeypatch):
    """unpack_bits wrong only when its rows leave a partial tile (16): whole tiles pass; the first ragged call is
    a new shape class, checked on a sample that keeps it ragged, caught, and then the reference runs."""
    real, calls = ub.unpack_bits, []

    def ragged_wrong(packed, bits, n):
        calls.append(packed.shape[0])
        out = real(packed, bits, n)
        return out ^ 1 if packed.shape[0] % 16 else out
    monkeypatch.setattr(ub, "unpack_bits", ragged_wrong)
    _unpack(32)
    assert [v.ok for v in selfcheck.verdicts()] == [True]
    with pytest.warns(selfcheck.QuantWMKernelWarning, match=r"unpack_bits \[2-bit\] uint8 on cpu at R=16n\+r"):
        got = _unpack(37)
    assert torch.equal(got, unpack_bits_ref(*_unpack_args(37)))  # the reference's codes, not the kernel's
    assert [(v.shape_class, v.ok) for v in selfcheck.verdicts()] == [("R=16n, bytes=16, n=64", True),
                                                                    ("R=16n+r, bytes=16, n=64", False)]
    launched = len(calls)
    _unpack(32)  # a kernel shown wrong is not trusted at any class: the reference, no launch
    assert len(calls) == launched


def test_a_shape_class_is_checked_once_however_its_lengths_vary():
    """The reference runs only in checks here (the kernel is right): once per class, not once per length."""
    checks = []

    def ref(*args):
        checks.append(args[0].shape[0])
        return unpack_bits_ref(*args)
    for rows in (16, 32, 48, 160):  # whole tiles
        _unpack(rows, ref)
    assert checks == [16] and selfcheck.verdicts()[0].shape_class == "R=16n, bytes=16, n=64"
    for rows in (1, 5, 17, 33, 7, 1):  # three new classes, each checked on its first call only
        _unpack(rows, ref)
    assert checks == [16, 1, 5, 17]
    classes = [v.shape_class.split(",")[0] for v in selfcheck.verdicts()]
    assert classes == ["R=16n", "R=1", "R<16", "R=16n+r"] and all(v.ok and v.checks == 1 for v in selfcheck.verdicts())


def test_an_attention_kernel_wrong_only_at_a_ragged_query_count_is_caught_on_the_first_ragged_chunk(monkeypatch):
    """span_attention wrong only past one 64-query tile with a partial one: chunks of 64 queries pass; a chunk of
    97 is a new shape class whose check keeps all 97 queries (one tile plus the remainder), and is caught."""
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    want = _attend_chunks()
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    real = sa.span_attention

    def ragged_wrong(q, acc, m, l, *args, **kwargs):
        real(q, acc, m, l, *args, **kwargs)
        if q.shape[1] > 64 and q.shape[1] % 64:
            acc.mul_(1.5)
    monkeypatch.setattr(sa, "span_attention", ragged_wrong)
    with pytest.warns(selfcheck.QuantWMKernelWarning, match=r"at Nq=64n\+r"):
        got = _attend_chunks()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert all(v.ok for v in selfcheck.verdicts() if v.shape_class.startswith("Nq=64n,"))
    assert {v.shape_class.split(",")[0] for v in selfcheck.fallbacks()} == {"Nq=64n+r"}


def _attend_chunks() -> list[torch.Tensor]:
    """Two committed chunks of 64 queries, then a chunk of 97 read uncommitted."""
    cache = KVCache(CacheConfig("kivi"), 1)
    g, outs = torch.Generator().manual_seed(0), []
    for i, n in ((0, 64), (1, 64), (2, 97)):
        q, k, v = (torch.randn(1, 2, n, 64, generator=g) for _ in range(3))
        outs.append(cache.attend(0, q, k, v, chunk=i, commit=i < 2))
    return outs


def test_the_shape_classes_and_samples_match_the_docstring():
    assert selfcheck.shape_class("quantize_pack", T=97, D=64) == "T=16n+r, D=64"
    assert selfcheck.shape_class("span_attention", Nq=1, N=1025, D=128) == "Nq=1, N=32n+r, D=128"
    assert [selfcheck.shape_class("span_attention", Nq=n) for n in (16, 20, 33, 64, 97)] == \
        ["Nq=16n", "Nq=16n+r", "Nq<64", "Nq=64n", "Nq=64n+r"]
    assert [selfcheck.sample_length("span_attention", "Nq", n) for n in (1, 20, 32, 64, 97, 1025, 4096)] == \
        [1, 20, 16, 64, 97, 65, 64]


class _Launch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` records the launch's keyword arguments."""

    def __init__(self):
        self.kw = {}

    def __getitem__(self, grid):
        return lambda *args, **kw: self.kw.update(kw)


def test_the_tiles_keyed_are_the_tiles_the_launchers_use(monkeypatch):
    """selfcheck.TILES mirrors the launchers' tile constants: a launcher that changes a tile changes a class."""
    launches = {}
    for module, name in ((qp, "_quantize_pack_kernel"), (ub, "_unpack_bits_kernel"), (pb, "_pack_bits_kernel"),
                         (ka, "_kmeans_assign_kernel"), (qa, "_qsac_assign_kernel"), (sa, "_span_attention_kernel")):
        launches[name] = _Launch()
        monkeypatch.setattr(module, name, launches[name])
    x = torch.randn(1, 40, 64)
    qp.quantize_pack(x, torch.ones(1, 40, 1), torch.zeros(1, 40, 1), 2, 64)
    ub.unpack_bits(torch.zeros(40, 16, dtype=torch.uint8), 2, 64)
    pb.pack_bits(torch.zeros(40, 64, dtype=torch.uint8), 2)
    ka.kmeans_assign(x, torch.randn(1, 20, 64))
    qa.qsac_assign(x, torch.randn(1, 20, 64), torch.ones(1, 64), 16, 2, 1.0)
    tiles = selfcheck.TILES
    assert launches["_quantize_pack_kernel"].kw["BLOCK_T"] == tiles["quantize_pack"]["T"]
    assert launches["_unpack_bits_kernel"].kw["BLOCK_R"] == tiles["unpack_bits"]["R"]
    assert launches["_pack_bits_kernel"].kw["BLOCK_R"] == tiles["pack_bits"]["R"]
    assert (launches["_kmeans_assign_kernel"].kw["BLOCK_N"], launches["_kmeans_assign_kernel"].kw["BLOCK_K"]) == \
        (tiles["kmeans_assign"]["N"], tiles["kmeans_assign"]["K"])
    assert launches["_qsac_assign_kernel"].kw["BLOCK_N"] == tiles["qsac_assign"]["N"]
    for nq in (1, 32, 33, 97):
        q = torch.randn(1, nq, 64)
        state = (torch.zeros(1, 1, nq, 64), torch.full((1, 1, nq), float("-inf")), torch.zeros(1, 1, nq))
        sa.span_attention(q, *state, span_args.full_side(x), span_args.full_side(x), 0.125)
        kw = launches["_span_attention_kernel"].kw
        assert (kw["BLOCK_M"], kw["BLOCK_N"]) == (selfcheck.query_tile(nq), tiles["span_attention"]["N"])
