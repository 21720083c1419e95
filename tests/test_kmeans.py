"""Tests for quantwm/kmeans.py, quantwm/qsac.py (QSAC, docs/method.md §2.1) and quantwm/psac.py (PSAC, docs/method.md §2.2)."""
import pytest
import torch

from quantwm.core.kmeans import kmeans, kmeans_assign_ref, update_centroids, weighted_sqdist
from quantwm.core.psac import principal_basis, psac_basis, psac_correction, psac_encode, subspace_overlap
from quantwm.core.qsac import channel_sensitivity, qsac_assign_ref, qsac_cost_ref


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _blobs(S=4, per=40, K=4, D=16, spread=0.05, seed=0):
    """K well separated clusters per stream; returns x (S, K*per, D), true centres (S, K, D), labels (S, K*per)."""
    g = torch.Generator().manual_seed(seed)
    centres = 10 * torch.randn(S, K, D, generator=g)
    labels = torch.arange(K).repeat_interleave(per).expand(S, -1)
    perm = torch.stack([torch.randperm(K * per, generator=g) for _ in range(S)])
    labels = torch.gather(labels, 1, perm)
    noise = spread * torch.randn(S, K * per, D, generator=g)
    x = torch.gather(centres, 1, labels[..., None].expand(S, K * per, D)) + noise
    return x, centres, labels


def _random_spd(S, D, seed):
    a = _randn(S, D, D, seed=seed)
    return a @ a.transpose(1, 2) / D + 0.1 * torch.eye(D)


# --- k-means ---------------------------------------------------------------------------------------

def test_kmeans_deterministic_for_seed():
    x = _randn(4, 200, 32, seed=1)
    c1, ids1 = kmeans(x, 12, iters=4, seed=7)
    c2, ids2 = kmeans(x, 12, iters=4, seed=7)
    assert c1.shape == (4, 12, 32) and c1.dtype == torch.float32
    assert ids1.shape == (4, 200) and ids1.dtype == torch.int64
    assert torch.equal(c1, c2)
    assert torch.equal(ids1, ids2)


@pytest.mark.parametrize("iters", [1, 2, 50])
def test_kmeans_returned_ids_are_assignment_to_returned_centroids(iters):
    x = _randn(2, 150, 8, seed=2)
    c, ids = kmeans(x, 8, iters=iters, seed=0)
    assert torch.equal(ids, kmeans_assign_ref(x, c))


def test_kmeans_recovers_well_separated_clusters_from_rough_init():
    x, centres, labels = _blobs(S=4, per=40, K=4, seed=3)
    # a rough guess: every centre moved by about half the typical separation
    init = centres + 4.0 * _randn(*centres.shape, seed=30)
    c, ids = kmeans(x, 4, iters=20, seed=0, init=init)
    assert torch.equal(ids, labels)  # init[k] was a guess for cluster k, so the labels match
    assert (c - centres).norm(dim=-1).max() < 0.1
    assert (init - centres).norm(dim=-1).min() > 1.0  # the centroids really moved


def test_kmeans_random_init_draws_distinct_tokens():
    x = _randn(3, 50, 8, seed=31)
    c, ids = kmeans(x, 10, iters=0, seed=4)
    d = (c[:, :, None, :] - x[:, None, :, :]).abs().amax(-1)  # (S, K, N)
    hit = d.min(-1)
    assert (hit.values == 0).all()  # every centroid is one of the tokens
    for s in range(3):
        assert len(set(hit.indices[s].tolist())) == 10  # ... and all different
    assert torch.equal(ids, kmeans_assign_ref(x, c))


def test_kmeans_lloyd_lowers_inertia():
    x, _, _ = _blobs(S=4, per=40, K=4, seed=3)
    inertia = lambda c, ids: (x - torch.gather(c, 1, ids[..., None].expand_as(x))).square().sum()  # noqa: E731
    c0, ids0 = kmeans(x, 4, iters=0, seed=0)
    c1, ids1 = kmeans(x, 4, iters=20, seed=0)
    assert inertia(c1, ids1) < 0.5 * inertia(c0, ids0)


def test_kmeans_warm_start_returns_init_shape_and_converges_immediately():
    x, centres, labels = _blobs(S=3, per=30, K=5, D=8, seed=4)
    # the exact member means are a fixed point of Lloyd's iteration
    good = update_centroids(x, labels, centres)
    calls = []

    def counting_assign(xs, c):
        calls.append(c.clone())
        return kmeans_assign_ref(xs, c)

    c, ids = kmeans(x, 5, iters=10, seed=123, init=good, assign=counting_assign)
    assert c.shape == good.shape
    assert torch.equal(ids, labels)
    assert torch.allclose(c, good, atol=1e-5)
    assert len(calls) == 11  # initial assignment + every update: a fixed count, nothing read back to stop early
    assert torch.equal(calls[0], good)  # the warm start was used, not a random init
    assert all(torch.allclose(c_i, good, atol=1e-5) for c_i in calls)  # converged at once: later updates change nothing


def test_kmeans_early_stop_is_kept_on_the_device_and_freezes_where_qvg_stops():
    x = _randn(2, 200, 8, seed=7)
    stopped = []

    def stop_at(n):  # the reference: QVG's loop, stopping at the first update that changes at most `tol` of the ids
        c, ids = kmeans(x, 6, iters=0, seed=1)
        for _ in range(n):
            c = update_centroids(x, ids, c)
            new = kmeans_assign_ref(x, c)
            changed, ids = float((new != ids).float().mean()), new
            stopped.append(changed)
            if changed <= 0.02:
                break
        return c, ids
    c_ref, ids_ref = stop_at(30)
    assert 1 < len(stopped) < 30  # it did stop early, after some updates
    c, ids = kmeans(x, 6, iters=30, seed=1, tol=0.02)
    assert torch.equal(ids, ids_ref) and torch.allclose(c, c_ref)


def test_kmeans_warm_start_does_not_depend_on_seed():
    x = _randn(2, 120, 16, seed=5)
    init = _randn(2, 6, 16, seed=6)
    c1, ids1 = kmeans(x, 6, iters=3, seed=0, init=init)
    c2, ids2 = kmeans(x, 6, iters=3, seed=99, init=init)
    assert torch.equal(c1, c2) and torch.equal(ids1, ids2)


def test_kmeans_empty_cluster_keeps_previous_centroid():
    x, centres, _ = _blobs(S=2, per=20, K=3, D=8, seed=7)
    far = torch.full((2, 1, 8), 1e3)
    init = torch.cat([centres, far], dim=1)  # (S, 4, D): the 4th centroid attracts nobody
    c, ids = kmeans(x, 4, iters=5, init=init)
    assert (ids != 3).all()
    assert torch.equal(c[:, 3], far[:, 0])


def test_update_centroids_member_means_and_empty_keep_prev():
    x = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [10.0, 10.0]]])
    ids = torch.tensor([[0, 0, 2]])
    prev = torch.tensor([[[9.0, 9.0], [-5.0, 7.0], [0.0, 0.0]]])
    c = update_centroids(x, ids, prev)
    assert torch.equal(c, torch.tensor([[[1.0, 0.0], [-5.0, 7.0], [10.0, 10.0]]]))


def test_kmeans_clips_clusters_to_tokens():
    x = _randn(3, 5, 8, seed=8)
    c, ids = kmeans(x, 10, iters=3, seed=0)
    assert c.shape == (3, 5, 8)
    assert ids.min() >= 0 and ids.max() < 5
    # 5 distinct tokens, 5 centroids: every token is its own cluster
    assert torch.allclose(torch.gather(c, 1, ids[..., None].expand(3, 5, 8)), x)


@pytest.mark.parametrize("shape", [(10, 8), (2, 3, 4, 5), (2, 0, 8)])
def test_kmeans_rejects_bad_shapes(shape):
    with pytest.raises(ValueError, match=r"\(S, N, D\)"):
        kmeans(torch.zeros(shape), 2)


def test_kmeans_rejects_zero_clusters():
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans(_randn(1, 4, 2), 0)


def test_weighted_sqdist_matches_brute_force():
    x, c, w = _randn(2, 7, 5, seed=9), _randn(2, 3, 5, seed=10), _randn(2, 5, seed=11).abs()
    brute = ((x[:, :, None, :] - c[:, None, :, :]).square() * w[:, None, None, :]).sum(-1)
    assert torch.allclose(weighted_sqdist(x, c, w), brute, atol=1e-5)
    assert torch.allclose(weighted_sqdist(x, c), ((x[:, :, None] - c[:, None]).square()).sum(-1), atol=1e-5)


# --- QSAC ------------------------------------------------------------------------------------------

def test_channel_sensitivity_of_diagonal_stats_is_diag_over_mean():
    diag = torch.tensor([[1.0, 2.0, 3.0, 6.0], [4.0, 4.0, 4.0, 4.0]])
    w = channel_sensitivity(torch.diag_embed(diag))
    assert torch.allclose(w, diag / diag.mean(-1, keepdim=True))
    assert torch.allclose(w[0], torch.tensor([1 / 3, 2 / 3, 1.0, 2.0]))
    # off-diagonal entries do not matter
    full = torch.diag_embed(diag) + 0.5 * (torch.ones(4, 4) - torch.eye(4))
    assert torch.allclose(channel_sensitivity(full), w)


def test_channel_sensitivity_of_zero_stats_is_uniform():
    assert torch.equal(channel_sensitivity(torch.zeros(2, 6, 6)), torch.ones(2, 6))


def _j_brute(k, c, w, G, bits, lam):
    """J(k, c) of docs/method.md §2.1, one pair at a time, in plain Python floats."""
    D = len(k)
    r = [k[i] - c[i] for i in range(D)]
    dist = sum(w[i] * r[i] ** 2 for i in range(D))
    rng = 0.0
    for g0 in range(0, D, G):
        grp = r[g0:g0 + G]
        W = sum(w[g0:g0 + G])
        rng += W * (max(grp) - min(grp)) ** 2
    return dist + lam * rng / (12 * (2 ** bits - 1) ** 2)


@pytest.mark.parametrize("bits,lam", [(2, 3.0), (4, 16.0), (2, 0.0)])
def test_qsac_cost_ref_matches_brute_force_J(bits, lam):
    S, N, K, D, G = 2, 5, 3, 8, 4
    x, c = _randn(S, N, D, seed=12), _randn(S, K, D, seed=13)
    w = channel_sensitivity(_random_spd(S, D, seed=14))
    J = qsac_cost_ref(x, c, w, G, bits, lam, block=2)  # several token blocks
    assert J.shape == (S, N, K)
    for s in range(S):
        for n in range(N):
            for k in range(K):
                ref = _j_brute(x[s, n].tolist(), c[s, k].tolist(), w[s].tolist(), G, bits, lam)
                assert J[s, n, k].item() == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_qsac_range_term_changes_the_assignment():
    # Two centroids at the same weighted distance: the one whose residual spreads evenly across the group
    # (small range) wins under QSAC; plain Euclidean picks the lower index.
    k = torch.zeros(1, 1, 4)
    c = torch.tensor([[[2.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]])  # both at squared distance 4
    w = torch.ones(1, 4)
    assert kmeans_assign_ref(k, c).item() == 0
    assert qsac_assign_ref(k, c, w, 4, 2, lam=16.0, candidates=None).item() == 1


@pytest.mark.parametrize("candidates", [None, 6, 9])  # 6 and 9 are >= K: the exact branch by design
def test_qsac_assign_ref_exact_equals_argmin_of_cost(candidates):
    S, N, K, D, G = 3, 50, 6, 16, 8
    x, c = _randn(S, N, D, seed=15), _randn(S, K, D, seed=16)
    w = channel_sensitivity(_random_spd(S, D, seed=17))
    ids = qsac_assign_ref(x, c, w, G, 2, 16.0, candidates=candidates)
    assert torch.equal(ids, qsac_cost_ref(x, c, w, G, 2, 16.0).argmin(-1))


def test_qsac_assign_ref_pruned_picks_best_among_candidates():
    S, N, K, D, G, m = 3, 60, 10, 16, 8, 3
    x, c = _randn(S, N, D, seed=18), _randn(S, K, D, seed=19)
    w = channel_sensitivity(_random_spd(S, D, seed=20))
    ids = qsac_assign_ref(x, c, w, G, 2, 16.0, candidates=m)
    cand = weighted_sqdist(x, c, w).topk(m, dim=-1, largest=False).indices
    J = qsac_cost_ref(x, c, w, G, 2, 16.0)
    assert (cand == ids[..., None]).any(-1).all()
    best_cand = torch.gather(J, 2, cand).min(-1).values
    assert torch.allclose(torch.gather(J, 2, ids[..., None]).squeeze(-1), best_cand, rtol=1e-5)


def test_qsac_pruning_to_8_of_64_centroids_really_prunes_and_is_measured():
    """candidates=8 < K=64 takes the pruned branch: it differs from the exact rule on some tokens (how many is
    measured here) and always picks the best under J among its shortlist."""
    S, N, K, D, G = 2, 400, 64, 64, 32
    x, c = _randn(S, N, D, seed=31), _randn(S, K, D, seed=32) * 0.7
    w = channel_sensitivity(_random_spd(S, D, seed=33))
    pruned = qsac_assign_ref(x, c, w, G, 2, 16.0, candidates=8)
    exact = qsac_assign_ref(x, c, w, G, 2, 16.0, candidates=None)
    differ = float((pruned != exact).float().mean())
    assert 0 < differ < 0.5, differ  # really prunes; most choices still agree
    J = qsac_cost_ref(x, c, w, G, 2, 16.0)
    assert (torch.gather(J, 2, pruned[..., None]) >= torch.gather(J, 2, exact[..., None]) - 1e-5).all()


@pytest.mark.parametrize("candidates", [8, None])
def test_qsac_assign_is_the_same_rule_on_the_kernel_path(monkeypatch, candidates):
    """The fast path must not change the rule: with the kernels forced (the interpreter here, CUDA on a GPU)
    qsac_assign returns what the CPU reference returns, for the pruned and for the exact rule."""
    from quantwm.core.qsac import qsac_assign

    S, N, K, D, G = 2, 97, 64, 64, 32
    x, c = _randn(S, N, D, seed=34), _randn(S, K, D, seed=35) * 0.7
    w = channel_sensitivity(_random_spd(S, D, seed=36))
    want = qsac_assign_ref(x, c, w, G, 2, 16.0, candidates=candidates)
    monkeypatch.setenv("QUANTWM_KERNELS", "triton")
    assert torch.equal(qsac_assign(x, c, w, G, 2, 16.0, candidates=candidates), want)


def test_qsac_assign_ref_without_range_term_is_weighted_nearest():
    S, N, K, D = 2, 40, 8, 16
    x, c = _randn(S, N, D, seed=21), _randn(S, K, D, seed=22)
    w = channel_sensitivity(_random_spd(S, D, seed=23))
    ids = qsac_assign_ref(x, c, w, 8, 2, lam=0.0, candidates=2)
    assert torch.equal(ids, weighted_sqdist(x, c, w).argmin(-1))


# --- PSAC ------------------------------------------------------------------------------------------

def test_principal_basis_diagonal_stats_picks_top_channels():
    diag = torch.tensor([1.0, 5.0, 3.0, 9.0, 2.0, 0.5, 7.0, 4.0])
    U = principal_basis(torch.diag(diag)[None], 3)
    assert U.shape == (1, 8, 3)
    expected = torch.zeros(8, 3)
    expected[3, 0] = expected[6, 1] = expected[1, 2] = 1.0  # eigenvalues 9, 7, 5
    assert torch.allclose(U[0].abs(), expected, atol=1e-6)


def test_principal_basis_orthonormal_and_ordered_by_eigenvalue():
    S, D, R = 3, 32, 8
    stats = _random_spd(S, D, seed=24)
    U = principal_basis(stats, R)
    assert U.shape == (S, D, R)
    assert torch.allclose(U.transpose(1, 2) @ U, torch.eye(R).expand(S, R, R), atol=1e-5)
    rayleigh = torch.diagonal(U.transpose(1, 2) @ stats @ U, dim1=-2, dim2=-1)  # (S, R)
    assert (rayleigh[:, :-1] >= rayleigh[:, 1:] - 1e-4).all()
    top = torch.linalg.eigvalsh(stats.double()).flip(-1)[:, :R].float()
    assert torch.allclose(rayleigh, top, rtol=1e-4)


@pytest.mark.parametrize("bits,max_ratio", [(4, 0.15), (8, 0.01)])
def test_psac_correction_shrinks_error_along_basis_only(bits, max_ratio):
    S, N, D, R = 4, 97, 64, 8
    err = _randn(S, N, D, seed=25) * 0.1
    diag = torch.linspace(0.1, 10.0, D)[torch.randperm(D, generator=torch.Generator().manual_seed(26))]
    stats = torch.diag(diag).expand(S, D, D)
    U = psac_basis(stats, R)
    assert U.shape == (S, D, R) and U.dtype == torch.float16
    t = psac_encode(err, U, bits)
    assert t.shape == (S, N, R) and t.axis == "token" and t.zero is not None  # per direction, asymmetric
    corr = psac_correction(t, U)
    assert corr.shape == err.shape
    top = diag.topk(R).indices
    rest = torch.ones(D, dtype=torch.bool)
    rest[top] = False
    before = err[..., top].norm()
    after = (err - corr)[..., top].norm()
    assert after < max_ratio * before
    # the orthogonal complement (every other channel) is untouched
    assert torch.equal((err - corr)[..., rest], err[..., rest])


def test_psac_correction_random_stats_projects_out_basis_error():
    S, N, D, R = 2, 128, 64, 8
    err = _randn(S, N, D, seed=27) * 0.05
    stats = _random_spd(S, D, seed=28)
    Ub = psac_basis(stats, R)
    t = psac_encode(err, Ub, 4)
    corr = psac_correction(t, Ub)
    U = principal_basis(stats, R)
    proj = lambda e: torch.bmm(e, U)  # noqa: E731  (S, N, D) -> (S, N, R)
    assert proj(err - corr).norm() < 0.15 * proj(err).norm()
    perp = lambda e: e - torch.bmm(proj(e), U.transpose(1, 2))  # noqa: E731
    # the correction lies in span(U) up to the fp16 rounding of the stored basis
    assert (perp(err - corr) - perp(err)).norm() < 2e-3 * corr.norm()
    # and the logit error e^T S e drops
    logit = lambda e: torch.einsum("snd,sde,sne->", e, stats, e)  # noqa: E731
    assert logit(err - corr) < logit(err)


def test_psac_stores_quantized_coefficients_compactly():
    S, N, D, R, bits = 2, 97, 64, 8, 4
    t = psac_encode(_randn(S, N, D, seed=29), psac_basis(torch.eye(D).expand(S, D, D), R), bits)
    assert t.codes.dtype == torch.uint8
    assert t.codes.shape == (S, N, R * bits // 8)
    assert t.scale.shape == (S, 1, R)  # one scale per (stream, direction) over the span


def test_psac_basis_is_reused_while_the_subspace_holds_and_replaced_when_it_moves():
    S, D, R = 2, 16, 4
    diag = torch.linspace(10.0, 0.1, D)
    stats = torch.diag(diag).expand(S, D, D).clone()
    U = psac_basis(stats, R)
    assert psac_basis(stats * 1.5, R, prev=U) is U  # same eigen-directions: the stored basis serves
    assert subspace_overlap(U, principal_basis(stats, R)).min() > 0.99
    moved = torch.diag(diag.flip(0)).expand(S, D, D).clone()  # the energy now sits in the other channels
    V = psac_basis(moved, R, prev=U)
    assert V is not U and subspace_overlap(U, V).max() < 0.01
    assert psac_basis(stats, R, prev=U, reuse=1.01) is not U  # reuse > 1: always a fresh basis


# --- adaptive PSAC rank (issue 12, "spend the bits where the Queries are") ---------------------------

def test_spectrum_ranks_hold_the_asked_share_of_each_heads_energy():
    from quantwm.core.psac import spectrum_ranks

    diag = torch.stack([torch.tensor([8.0, 1, 1, 0, 0, 0, 0, 0]), torch.ones(8)])
    ranks = spectrum_ranks(torch.diag_embed(diag), 0.8, max_rank=6)
    assert ranks.tolist() == [1, 6]  # 8/10 in one direction; the flat head needs 7 of 8, capped at 6
    assert spectrum_ranks(torch.diag_embed(diag), 0.81, 8).tolist() == [2, 7]
    with pytest.raises(ValueError, match="share"):
        spectrum_ranks(torch.eye(4)[None], 0.0, 4)


def test_adaptive_rank_psac_stores_each_stream_at_its_own_rank_and_corrects_there():
    from quantwm.core.methods import SpanContext, get_method

    S_, N_, D_ = 3, 128, 64
    x = _randn(S_, N_, D_, seed=40)
    Q = torch.linalg.qr(_randn(S_, D_, D_, seed=41))[0]
    ev = torch.stack([2.0 ** -torch.arange(D_).float(), 2.0 ** -torch.arange(D_).float(), torch.ones(D_)])
    stats = Q @ torch.diag_embed(ev) @ Q.transpose(1, 2)
    fixed = get_method("quantwm", psac_rank=16)
    adaptive = get_method("quantwm", psac_rank=16, psac_energy=0.9)
    ctx = lambda: SpanContext(stats=stats, history=100)  # noqa: E731
    ef, ea = fixed.encode(x, "k", ctx()), adaptive.encode(x, "k", ctx())
    assert ea.components()["psac_ranks"].tolist() == [4, 4, 16]  # 90% of 1, 1/2, 1/4, ... takes 4 directions
    assert ea.nbytes() < ef.nbytes()  # concentrated heads store fewer coefficients
    assert ea.components()["psac_codes.0"].shape == (1, N_, 2) and ea.components()["psac_codes.2"].shape == (1, N_, 8)
    # what the logits feel, eᵀ S e per stream: the 4 kept directions remove most of it (90% of the energy)
    def weighted(m, enc=None):
        e = m.decode(enc if enc is not None else m.encode(x, "k", ctx())) - x
        return torch.einsum("snd,sde,sne->s", e, stats, e)
    none = weighted(get_method("quantwm", psac=False))
    assert (weighted(adaptive, ea)[:2] < 0.15 * none[:2]).all()
    assert torch.allclose(weighted(adaptive, ea)[2], weighted(fixed, ef)[2])  # the diffuse head keeps all 16
    assert ea.kernel_side is None and ef.kernel_side is not None  # ragged ranks: the reference path reads them
