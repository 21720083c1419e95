"""quantwm/core/trellis.py and layouts/trellis.py: the bitshift trellis code (its codebook, the Viterbi search, the
random-access read from the `Channels` buffer) and `quantwm-trellis` through the cache."""
import itertools

import pytest
import torch

from quantwm.core import trellis
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.core.layouts.channels import Channels, _byte_layout
from quantwm.core.layouts.trellis import TrellisChannels
from quantwm.core.lloyd_max import lloyd_max


def test_the_codebook_is_computed_from_the_state_and_close_to_a_unit_gaussian():
    cb = trellis.codebook()
    assert cb.shape == (1 << trellis.STATE_BITS,)
    assert abs(cb.mean()) < 0.02 and abs(cb.std() - 1) < 0.025 and cb.abs().max() < 3.5  # 256 values
    assert torch.equal(trellis.mad(torch.arange(256)), cb)
    # the stored format: a span coded today must decode the same tomorrow
    assert [round(v, 4) for v in cb[[0, 1, 2, 255]].tolist()] == [-1.2517, -0.839, -0.4263, 0.4601]


def test_each_width_decodes_through_its_table_by_the_top_bits_of_its_window():
    """tables(): widths 1-4 the stored tables of 2^(k + 4) values (kernels/trellis_tables.py, as the JSON the
    training wrote holds them), read by the window's top k + 4 bits; widths 5-8 the computed codebook; width 0 zeros."""
    import json
    from pathlib import Path

    from quantwm.kernels.trellis_tables import TRAINED

    tables, s = trellis.tables(), torch.arange(256)
    assert tables.shape == (9, 256) and tables.dtype == torch.float32 and torch.equal(tables[0], torch.zeros(256))
    assert trellis.TABLE_BITS == (0, 5, 6, 7, 8, 8, 8, 8, 8)
    saved = json.loads((Path(__file__).parents[1] / "docs/frontier/trellis-tables-mixture.json").read_text())["tables"]
    for k in range(1, 9):
        if k <= 4:
            small = torch.tensor(saved[f"{k},4"])
            assert torch.equal(torch.tensor(TRAINED[k]), small) and len(small) == 1 << (k + 4)
            assert torch.equal(tables[k], small[s >> (4 - k)])
            assert torch.equal(trellis.table_of(tables, k), small)
            assert abs(small.mean()) < 0.05 and 0.8 < small.square().mean().sqrt() < 1.4  # 0.91-1.31: tails for Laplacians
        else:
            assert torch.equal(tables[k], trellis.codebook()) and torch.equal(trellis.table_of(tables, k), tables[k])
    # a span's states decode through them: the low bits of a window below its width's state change nothing
    widths = torch.tensor([[1, 2, 3, 4, 5]])
    state = torch.randint(0, 256, (1, 7, 5), generator=torch.Generator().manual_seed(1))
    low = state & torch.tensor([7, 3, 1, 0, 0])  # bits under TABLE_BITS
    assert torch.equal(trellis.values(state, widths), trellis.values(state - low, widths))
    assert torch.equal(trellis.values(state, widths)[..., 4], trellis.codebook()[state[..., 4]])


def _path_values(codes: torch.Tensor, k: int, tail: bool = False, values: torch.Tensor | None = None) -> torch.Tensor:
    """Decode codes (M, N) by the shift register itself: s_t = (s_{t-1} >> k) | (code_t << (L - k)), from s_{-1} = 0
    or (tail) from the state the register holds after the last code (s_{-1} = s_{N-1}); each window's value in
    `values` (2^L,), by default width k's row of the format's tables."""
    values = trellis.tables()[k] if values is None else values
    state = torch.zeros(codes.shape[0], dtype=torch.long)
    out = []
    for _ in range(2 if tail else 1):
        out = []
        for t in range(codes.shape[1]):
            state = (state >> k) | (codes[:, t] << (trellis.STATE_BITS - k))
            out.append(values[state])
    return torch.stack(out, 1)


def _end_state(codes: torch.Tensor, widths: torch.Tensor, at: int) -> torch.Tensor:
    """The state (M,) int64 after code `at` of every row of codes (M, N) of widths (M,) (0-8), read from state 0:
    the L bits that end where code `at` ends (the codes before the row's first read 0), rebuilt from the codes: what
    a tail-biting path must end in, and what the encoder reads off the window search's states instead."""
    state_bits = trellis.STATE_BITS
    j = torch.arange(state_bits, device=codes.device)  # code at − j ...
    pos = at - j
    window = codes[:, pos.clamp_min(0)] * (pos >= 0)  # (M, L)
    shift = state_bits - widths.long()[:, None] * (j + 1)  # ... sits at bit `shift` of the state (< 0: partly out)
    part = torch.where(shift >= 0, window << shift.clamp_min(0), window >> (-shift).clamp(0, 63))
    return torch.where(shift > -widths.long()[:, None], part, 0).sum(1)


@pytest.mark.parametrize("k,n,tail", [(1, 7, False), (2, 4, False), (3, 3, False), (1, 12, True), (2, 6, True),
                                      (3, 4, True), (5, 3, True)])
def test_viterbi_finds_the_least_error_path(k, n, tail):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, n, generator=g)
    every = torch.tensor(list(itertools.product(range(1 << k), repeat=n)))  # (2^(k n), n): every code sequence
    start = None
    if tail:  # a tail-biting path ends in its start state: the sequences that do
        start = torch.randint(0, 1 << trellis.STATE_BITS, (3,), generator=g)
        ends = _end_state(every, torch.full((len(every),), k), n - 1)
    codes = trellis.viterbi(x, k, trellis.codebook(), start)
    got = (_path_values(codes, k, tail, trellis.codebook()) - x).square().sum(1)
    for row in range(x.shape[0]):
        pool = every if start is None else every[ends == start[row]]
        if start is not None:
            assert _end_state(codes[row:row + 1], torch.tensor([k]), n - 1) == start[row]
            assert len(pool) == 1 << (n * k - trellis.STATE_BITS)
        best = (_path_values(pool, k, tail, trellis.codebook()) - x[row]).square().sum(1).min()
        assert got[row] <= best + 1e-5
    with pytest.raises(ValueError, match="needs one start state a row"):
        trellis.viterbi(x[:, :2], 2, trellis.codebook(), torch.zeros(3, dtype=torch.long))  # 4 bits a row


@pytest.mark.parametrize("n", [37, 5])  # a stream of 5 codes of 1 or 2 bits is shorter than a state: no wrap
def test_a_span_decodes_from_its_buffer_as_the_search_coded_it(n):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(2, n, 5, generator=g) * 3 + 1
    bits = torch.tensor([[0, 1, 2, 5, 8], [3, 4, 6, 7, 2]])
    layout = TrellisChannels.code(r, bits)
    low, step = layout.low.float(), layout.step_.float()
    codes = trellis.encode(r, bits, low, step)
    path = trellis.encode(r, bits, low, step, states=True)  # the search's own states: what the buffer's reader reads
    drop = torch.tensor(trellis.TABLE_BITS)[bits][:, None, :]  # each width reads its window's top bits
    read = trellis.states(layout.codes, layout.offsets, bits, n)
    assert torch.equal(path.long(), read >> (8 - drop) << (8 - drop))
    for s, d in itertools.product(range(2), range(5)):
        k = int(bits[s, d])
        if k:
            want = low[s, d] + step[s, d] * _path_values(codes[s, :, d][None], k, n * k >= trellis.STATE_BITS)[0]
            torch.testing.assert_close(layout.decode()[s, :, d], want)
    assert torch.equal(layout.decode()[0, :, 0], torch.zeros(n))  # a 0-bit channel: its centroid alone
    assert layout.nbytes() == bits.numel() * 5 + int(_byte_layout(bits, n)[1])  # Channels' bytes to the byte


def test_a_channel_its_grid_codes_better_is_stored_on_the_grid_in_the_same_bytes():
    g = torch.Generator().manual_seed(6)
    r = torch.randn(2, 64, 4, generator=g)
    r[:, :, 1] = torch.randint(0, 2, (2, 64), generator=g) * 2.0 - 1  # two values: a 1-bit grid holds them exactly
    r[:, :, 3] = torch.randint(0, 8, (2, 64), generator=g).float()  # eight levels: a 3-bit grid, exactly
    bits = torch.tensor([[2, 1, 0, 3], [2, 1, 4, 3]])
    alpha = torch.ones(2, 4)
    plain, mixed = TrellisChannels.code(r, bits), TrellisChannels.code(r, bits, alpha)
    assert plain.grid is None and mixed.grid.tolist() == [[False, True, False, True], [False, True, False, True]]
    err = {name: (lay.decode() - r).square().sum(1) for name, lay in (("plain", plain), ("mixed", mixed))}
    grid = (Channels.code(r, bits, alpha).decode() - r).square().sum(1)
    torch.testing.assert_close(err["mixed"], torch.minimum(err["plain"], grid))  # the better of the two, per channel
    assert err["mixed"][:, [1, 3]].max() < 1e-6
    assert mixed.nbytes() == plain.nbytes() and torch.equal(mixed.width_byte & 15, bits.to(torch.uint8))
    center = torch.where(mixed.grid, mixed.decode().mean(1), mixed.low.float() * (bits > 0))  # a trellis one: its mean
    torch.testing.assert_close(mixed.make_center(), center)
    step = mixed.step()[:, 0]
    assert torch.equal(step[:, [1, 3]], mixed.step_.float()[:, [1, 3]])  # a grid channel's Jensen step: its own
    with pytest.raises(ValueError, match=r"grid clips must be \(streams, channels\)"):
        TrellisChannels.code(r, bits, torch.ones(4))


def test_a_channels_first_samples_code_as_well_as_the_rest():
    x = torch.randn(1, 128, 96, generator=torch.Generator().manual_seed(11))  # 96 channels of 128 tokens
    for k in (1, 2, 3):
        err = (TrellisChannels.code(x, torch.full((1, 96), k)).decode() - x).square().mean((0, 2))
        assert err[:4].mean() < 1.5 * err[16:112].mean(), k  # from state 0: 3.4x at 1 bit (the window read zeros)


def test_trellis_codes_beat_the_best_scalar_grid_on_a_gaussian():
    x = torch.randn(1, 8, 1728, generator=torch.Generator().manual_seed(3)).permute(0, 2, 1)  # 8 channels
    for k, bound in ((1, 0.25), (2, 0.0625), (3, 0.015625)):
        mse = (TrellisChannels.code(x, torch.full((1, 8), k)).decode() - x).square().mean() / x.var()
        # under Lloyd-Max by at least 0.6 dB at 1 bit and 1 dB at 2-3 (the stored tables: 0.64, 1.3, 1.5 dB here)
        assert bound < mse < lloyd_max(k).mse * (0.87 if k == 1 else 0.8), (k, float(mse))


def test_bad_widths_and_a_constant_channel():
    with pytest.raises(ValueError, match="trellis widths are 1-8 bits, got 9"):
        trellis.viterbi(torch.zeros(1, 4), 9, trellis.codebook())
    with pytest.raises(ValueError, match="trellis widths are 0-8 bits a channel, got 0..9"):
        TrellisChannels.code(torch.zeros(1, 4, 2), torch.tensor([[0, 9]]))
    with pytest.raises(ValueError, match=r"must be \(streams, channels\) = \(1, 2\), got \(2,\)"):
        TrellisChannels.code(torch.zeros(1, 4, 2), torch.tensor([1, 2]))
    r = torch.full((1, 16, 2), 0.75)
    torch.testing.assert_close(TrellisChannels.code(r, torch.tensor([[2, 8]])).decode(), r, rtol=0, atol=1e-4)


def test_quantwm_trellis_stores_what_quantwm_alloc_stores_and_codes_the_keys_closer():
    g = torch.Generator().manual_seed(1)
    q_dirs = torch.randn(64, 4, generator=g)
    caches = {m: KVCache(CacheConfig(m, target="k", budget=2.5, keep_exact=True), 1) for m in ("quantwm-alloc", "quantwm-trellis")}
    for chunk in range(4):
        k = torch.randn(1, 2, 128, 64, generator=g) * torch.linspace(0.2, 3, 64)
        q = (torch.randn(1, 2, 128, 4, generator=g) @ q_dirs.T) + 0.1 * torch.randn(1, 2, 128, 64, generator=g)
        v = torch.randn(1, 2, 128, 64, generator=g)
        for cache in caches.values():
            cache.attend(0, q, k, v, chunk=chunk, commit=True)
    plain, coded = caches["quantwm-alloc"], caches["quantwm-trellis"]
    assert coded.bits_per_element() == plain.bits_per_element() <= 2.5
    assert "trellis" in coded.configuration["k"]
    assert any("trellis" in s.k_enc.describe() for s in coded.inspect(0) if s.k_enc is not None and s.k_enc.quantized)
    exact = plain.keys(0, exact=True)
    assert torch.equal(exact, coded.keys(0, exact=True))
    err = {m: (q @ (c.keys(0) - exact).transpose(-1, -2)).square().mean() for m, c in caches.items()}  # logit error
    assert err["quantwm-trellis"] < 0.9 * err["quantwm-alloc"]  # 0.83x measured


def test_the_fused_kernel_reads_a_trellis_span_as_its_torch_twin():
    from quantwm.kernels.span_args import TRELLIS
    from quantwm.kernels.span_attention import span_attention

    from quantwm.core.attention import merge_splits, new_state, span_attention_ref

    g = torch.Generator().manual_seed(5)
    S, N, D = 2, 45, 32
    keys = torch.randn(S, N, D, generator=g)
    keys[:, :, ::4] = torch.randint(0, 2, (S, N, D // 4), generator=g).float()  # channels a grid codes better
    k = TrellisChannels.code(keys, torch.randint(0, 9, (S, D), generator=g), torch.ones(S, D))
    assert bool(k.grid.any()) and not bool(k.grid.all())  # both kinds of channel in the span
    v = TrellisChannels.code(torch.randn(S, N, D, generator=g), torch.randint(0, 9, (S, D), generator=g))
    assert k.kernel_side.form == TRELLIS
    q = torch.randn(S, 7, D, generator=g)
    maxima = []
    for jensen in (False, True):
        outs = []
        for fold, P in ((span_attention, 2), (span_attention_ref, 1)):
            acc, m, l = new_state(S, P, 7, D, "cpu")
            sides = (k.kernel_side, v.kernel_side) if fold is span_attention else (k, v)
            fold(q, acc, m, l, *sides, 0.2, jensen=jensen)
            outs.append(merge_splits(acc, m, l))
            maxima.append(m.amax(1))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(maxima[2], maxima[3], rtol=1e-5, atol=1e-5)
    assert (maxima[2] < maxima[0]).all()  # the Jensen term lowers every logit of the span (one number a query)


def test_the_viterbi_kernel_codes_every_width_as_the_reference_does():
    from quantwm.kernels.trellis_viterbi import trellis_viterbi

    g = torch.Generator().manual_seed(9)
    x = torch.randn(10, 23, generator=g)
    widths = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 2])
    start = torch.randint(0, 1 << trellis.STATE_BITS, (10,), generator=g)
    for tail in (False, True):  # from state 0; tail-biting through `start`
        got = trellis_viterbi(x, widths, trellis.tables(), start if tail else None,
                              scratch_bytes=3 * 23 * 16)  # batches of 3 rows (16 backpointers a step)
        for row, k in enumerate(widths.tolist()):
            drop = 8 - trellis.TABLE_BITS[k]  # width k's trellis: the window's top bits, its start's too
            want = trellis.viterbi(x[row:row + 1], k, trellis.table_of(trellis.tables(), k),
                                   start[row:row + 1] >> drop if tail else None)[0] if k else torch.zeros(23, dtype=torch.long)
            assert torch.equal(got[row], want), (k, tail)
        assert torch.equal(got, trellis.trellis_viterbi_ref(x, widths, trellis.tables(), start if tail else None))
        # the path's states instead: their top bits are the codes, and the reference's states are the same
        states = trellis_viterbi(x, widths, trellis.tables(), start if tail else None, states=True)
        assert states.dtype == torch.uint8
        assert torch.equal(states.long() >> (trellis.STATE_BITS - widths[:, None]), got)
        drop = 8 - torch.tensor(trellis.TABLE_BITS)[widths][:, None]
        assert torch.equal(states.long() & ((1 << drop) - 1), torch.zeros_like(got))  # width k's state: the top bits
        assert torch.equal(states, trellis.trellis_viterbi_ref(x, widths, trellis.tables(), start if tail else None,
                                                               states=True))
    with pytest.raises(ValueError, match="need widths"):
        trellis_viterbi(x, widths[:3], trellis.tables())


def test_the_viterbi_kernel_reads_a_span_in_place_normalised_as_the_reference_does():
    """A span (S, N, D) searched channel by channel, each (y − mean) / scale as it is read: the codes of the rows
    normalised beforehand, kernel and reference alike."""
    from quantwm.kernels.trellis_viterbi import trellis_viterbi

    g = torch.Generator().manual_seed(4)
    y = torch.randn(2, 19, 5, generator=g) * 3 + 1
    widths = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 2])
    mean, scale = torch.randn(10, generator=g), torch.rand(10, generator=g) + 0.5
    rows = (y.permute(0, 2, 1).reshape(10, 19) - mean[:, None]) / scale[:, None]
    assert torch.equal(trellis.normalised_rows(y, mean, scale), rows)
    start = torch.randint(0, 1 << trellis.STATE_BITS, (10,), generator=g)
    for tail in (False, True):
        want = trellis.trellis_viterbi_ref(rows, widths, trellis.tables(), start if tail else None, states=True)
        for search in (trellis_viterbi, trellis.trellis_viterbi_ref):
            got = search(y, widths, trellis.tables(), start if tail else None, states=True, mean=mean, scale=scale)
            assert torch.equal(got, want), (search, tail)
        # batches of 3 rows (each batch's first row mid-stream: row0 % D != 0) and rows too short to wrap (3 x k < 8)
        batched = trellis_viterbi(y, widths, trellis.tables(), start if tail else None, states=True, mean=mean,
                                  scale=scale, scratch_bytes=3 * 19 * 16)
        assert torch.equal(batched, want), tail
        short = trellis_viterbi(y[:, :3], widths, trellis.tables(), start if tail else None, mean=mean, scale=scale)
        assert torch.equal(short, trellis.trellis_viterbi_ref(rows[:, :3], widths, trellis.tables(),
                                                              start if tail else None)), tail
    for search in (trellis_viterbi, trellis.trellis_viterbi_ref):
        with pytest.raises(ValueError, match="mean and scale both None"):
            search(y, widths, trellis.tables(), mean=mean)
        with pytest.raises(ValueError, match="rows, samples"):
            search(y[0, 0], widths, trellis.tables())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_wrap_state_is_the_state_the_window_path_ends_its_last_sample_in(k):
    """wrap_states reads the end state off the window search's states: the L bits that end at the row's last
    sample, as _end_state computes them from the same path's codes."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(4, 41, generator=g)
    got = trellis.wrap_states(x, lambda w: trellis.viterbi(w, k, trellis.codebook(), states=True), window=9)
    window = torch.cat([x[:, 41 - 9:], x[:, :9]], 1)
    codes = trellis.viterbi(window, k, trellis.codebook())
    assert torch.equal(got, _end_state(codes, torch.full((4,), k), 8))


def test_a_span_coded_on_the_kernel_path_stores_the_same_bytes(monkeypatch):
    """The search, and with clips the grid-or-trellis choice and the packing (kernels/trellis_choice.py,
    kernels/pack_channels.py given the states), store what the PyTorch path stores: the same bytes and grid flags,
    the same tables (to 1 fp16 ulp where the Values' stretch adds its sums in another order)."""
    g = torch.Generator().manual_seed(4)
    r = torch.randn(2, 19, 6, generator=g)
    r[1, :, 3] = torch.randint(0, 4, (19,), generator=g).float()  # four levels: on its 2-bit grid exactly
    bits = torch.tensor([[0, 1, 2, 3, 8, 4], [5, 6, 7, 2, 2, 0]])
    alpha = torch.tensor([[1.0, 0.85, 0.7, 1.0, 1.0, 0.55], [1.0, 0.85, 1.0, 1.0, 0.42, 1.0]])
    ref = {(clip, unbias): TrellisChannels.code(r, bits, alpha if clip else None, unbias=unbias)
           for clip in (False, True) for unbias in (False, True)}
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    ulp = lambda a, b: ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -10 + 1e-7).all()  # fp16: 1 ulp
    for (clip, unbias), want in ref.items():
        fast = TrellisChannels.code(r, bits, alpha if clip else None, unbias=unbias)
        assert torch.equal(fast.codes, want.codes), (clip, unbias)
        assert torch.equal(fast.on_grid, want.on_grid) and torch.equal(fast.low_read, want.low_read.float())
        same = torch.equal if not unbias else ulp
        assert same(fast.low, want.low) and same(fast.step_, want.step_), (clip, unbias)
    assert ref[True, False].grid[1, 3] and ref[True, False].grid.any() and not ref[True, False].grid.all()


def test_a_trellis_span_commits_on_the_e4m3_path_without_reading_its_widest_channel():
    cache = KVCache(CacheConfig("quantwm-trellis", target="k", budget=2.5, lowp="e4m3", sink_chunks=0,
                                recent_chunks=0), 1)
    g = torch.Generator().manual_seed(2)
    cache.observe(0, torch.randn(1, 2, 64, 64, generator=g))
    cache.write(0, torch.randn(1, 2, 64, 64, generator=g), torch.randn(1, 2, 64, 64, generator=g), 0)
    cache.commit(0, 0)
    (span,) = [s for s in cache.inspect(0) if s.k_enc is not None and s.k_enc.quantized]
    layout = span.k_enc.coded()[1]
    residual = getattr(layout, "residual", layout)
    assert isinstance(residual, TrellisChannels) and "max_bits" not in residual.__dict__  # no host read for it


def test_the_search_takes_its_trellis_size_from_its_values():
    """viterbi reads L from its values (the stored code's 2^8, or 2^10 as benchmarks/trellis_gain.py --tables
    --state-bits 10 measures it): more states code a Gaussian closer, and a table of no power of two is refused."""
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(4))
    mse = {}
    for L in (8, 10):
        values = trellis.mad(torch.arange(1 << L))
        codes = trellis.viterbi(x, 2, values)
        state, err = torch.zeros(32, dtype=torch.long), 0.0
        for t in range(x.shape[1]):
            state = (state >> 2) | (codes[:, t] << (L - 2))
            err += (values[state] - x[:, t]).square().sum().item()
        mse[L] = err / x.numel()
    assert mse[10] < mse[8] < 0.13  # both under the 2-bit uniform grid's 0.12-0.13
    with pytest.raises(ValueError, match=r"needs 2\^L >= 2\^2 state values, got 300"):
        trellis.viterbi(x, 2, torch.zeros(300))
    with pytest.raises(ValueError, match=r"needs 2\^L >= 2\^3 state values, got 4"):
        trellis.viterbi(x, 3, torch.zeros(4))


def test_the_allocators_two_prices_of_a_trellis_channel():
    """"ratio": the grid's error times the Gaussian ratio; "variance": the lesser of the grid's error and the
    trellis's on a Gaussian of the channel's variance, so a channel its grid codes exactly is priced at 0."""
    from quantwm.core.allocate import error_tables
    from quantwm.core.methods.allocator import QuantWMAlloc, trellis_errors

    g = torch.Generator().manual_seed(8)
    r = torch.randn(1, 256, 3, generator=g) * torch.tensor([1.0, 3.0, 1.0])
    r[0, :, 2] = torch.randint(0, 4, (256,), generator=g).float()  # four levels: exact on a 2-bit grid
    E, _ = error_tables(r)
    ratio = trellis_errors(E, r, "ratio")
    assert torch.allclose(ratio, E * torch.tensor(trellis.ERROR_RATIO).clamp(max=1))
    variance = trellis_errors(E, r, "variance")
    unit = torch.tensor(trellis.UNIT_MSE)
    expect = torch.minimum(E, r.var(1, correction=0)[..., None] * 256 * unit)
    assert torch.allclose(variance[..., 1:], expect[..., 1:]) and torch.equal(variance[..., 0], E[..., 0])
    assert (variance <= E).all() and variance[0, 2, 2] < 1e-6  # an exact grid stays exact
    assert 0.6 < (variance[0, :2, 2] / ratio[0, :2, 2]).mean() < 1.6  # Gaussian channels: about the ratio's price
    with pytest.raises(ValueError, match="trellis_price must be"):
        QuantWMAlloc(codes="trellis", trellis_price="gaussian")


def test_quantwm_trellis_v_moves_a_quarter_bit_of_one_budget_from_the_values_to_the_keys():
    """quantwm-trellis-v at B: the Keys on grids at B + 0.25, the Values in the trellis at B − 0.25, B together."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=g) for _ in range(3))
    cache = KVCache(CacheConfig("quantwm-trellis-v", budget=2.5, sink_chunks=0, recent_chunks=0), 1)
    cache.observe(0, q)
    cache.write(0, k, v, 0)
    cache.commit(0, 0)
    said = cache.configuration
    assert said["k"].startswith("quantwm-trellis-v at 2.75 bits") and said["v"].startswith("quantwm-trellis-v at 2.25 bits")
    elems = 128 * 2 * 64
    assert 8 * cache.quantized_bytes("k") / elems == pytest.approx(2.75, abs=0.01)
    assert 8 * cache.quantized_bytes("v") / elems == pytest.approx(2.25, abs=0.01)
    assert cache.bits_per_element() <= 2.5 + 1e-9
    (span,) = [s for s in cache.inspect(0) if s.k_enc is not None and s.k_enc.quantized]
    assert not isinstance(getattr(span.k_enc.coded()[1], "residual", span.k_enc.coded()[1]), TrellisChannels)
    assert isinstance(getattr(span.v_enc.coded()[1], "residual", span.v_enc.coded()[1]), TrellisChannels)


def test_kind_budgets_moves_bits_only_from_one_budget_for_both_halves():
    from quantwm.core.budget import BudgetError, kind_budgets

    assert kind_budgets("quantwm-trellis-v", 2.5, 2.5) == (2.75, 2.25)
    assert kind_budgets("quantwm-trellis-v", 2.5, 2.0) == (2.5, 2.0)  # budgets apart: as given
    assert kind_budgets("quantwm-trellis-v", 2.5, 2.5, target="k") == (2.5, 2.5)  # one half quantized
    assert kind_budgets("quantwm", 2.5, 2.5) == kind_budgets("kivi", 2.5, 2.5) == (2.5, 2.5)
    assert kind_budgets("quantwm", 3.0, 3.0, options={"key_extra_bits": 0.5}) == (3.5, 2.5)  # --set on quantwm
    assert kind_budgets("quantwm", None, None) == (None, None)
    assert kind_budgets("quantwm-trellis-v", 2.5, 2.5, options={"budget": 3.0}) == (2.75, 2.25)  # the budget given
    with pytest.raises(BudgetError, match="a budget of 0.25 leaves its Values none"):
        kind_budgets("quantwm-trellis-v", 0.25, 0.25)
    with pytest.raises(ValueError, match="key_extra_bits must be"):
        kind_budgets("quantwm", 2.5, 2.5, options={"key_extra_bits": -0.5})
    with pytest.raises(ValueError, match="key_extra_bits must be"):
        kind_budgets("quantwm", 2.5, 2.5, options={"key_extra_bits": True})


def test_an_allocators_own_budget_is_split_as_a_cache_budget_is_and_a_budget_given_twice_is_refused():
    """The frontier's presets and --set budget=B give the allocator its budget: quantwm-trellis-v splits it too."""
    for options, target, want in (((("budget", 2.5),), "kv", (2.75, 2.25)), ((), "kv", (2.75, 2.25)),
                                  ((("budget", 3.0),), "k", (3.0, 3.0))):
        cache = KVCache(CacheConfig("quantwm-trellis-v", target=target, method_options=options), 1)
        assert (cache.k_method.budget, cache.v_method.budget) == want, (options, target)
    cache = KVCache(CacheConfig("quantwm-alloc", budget=4.0, method_options=(("key_extra_bits", 3.0),)), 1)
    assert cache.k_method.budget == 2.5  # a cache budget splits at its first span: the default 2.5 is not split
    with pytest.raises(ValueError, match="the budget is given twice"):
        CacheConfig("quantwm", budget=2.5, method_options=(("budget", 3.0),))


def test_trellis_kinds_codes_only_the_halves_it_names():
    """trellis_kinds="v": the Values in trellis codes, the Keys on quantwm-alloc's grids (and "k" the other way)."""
    from quantwm.core.methods.allocator import QuantWMAlloc

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(3))
    for kinds, want in (("v", {"k": False, "v": True}), ("k", {"k": True, "v": False})):
        cache = KVCache(CacheConfig("quantwm-trellis", budget=2.5, sink_chunks=0, recent_chunks=0,
                                    method_options=(("trellis_kinds", kinds),)), 1)
        cache.observe(0, q)
        cache.write(0, k, v, 0)
        cache.commit(0, 0)
        (span,) = [s for s in cache.inspect(0) if s.k_enc is not None and s.k_enc.quantized]
        for kind, enc in (("k", span.k_enc), ("v", span.v_enc)):
            layout = enc.coded()[1]
            assert isinstance(getattr(layout, "residual", layout), TrellisChannels) == want[kind], (kinds, kind)
    described = {kinds: QuantWMAlloc(codes="trellis", trellis_kinds=kinds).grid() for kinds in ("k", "v", "kv")}
    assert "trellis codes on the Values, the Keys on grids" in described["v"]
    assert "trellis codes on the Keys, the Values on grids" in described["k"]
    assert "(bitshift trellis codes)" in described["kv"]
    with pytest.raises(ValueError, match="trellis_kinds must be"):
        QuantWMAlloc(codes="trellis", trellis_kinds="q")
