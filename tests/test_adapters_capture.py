"""TraceCapture: what it records from a run through chunk_attention, its budget and its errors."""
import pytest
import torch

from quantwm.adapters import TraceCapture, chunk_attention
from quantwm.core.cache import CacheConfig, KVCache
from quantwm.evaluation.trace import read_trace

TPF, HEADS, DIM = 8, 2, 64  # frames of 2x4 tokens, one frame per chunk


def _run(capture, config=CacheConfig("bf16"), n_chunks=4, layers=2, denoise_passes=1):
    """Random Q/K/V (B, H, L, D) per layer and chunk: denoising passes, then the committing clean pass."""
    cache = KVCache(config, layers)
    g = torch.Generator().manual_seed(0)
    for c in range(n_chunks):
        for p in range(denoise_passes + 1):
            for layer in range(layers):
                q, k, v = (torch.randn(1, HEADS, TPF, DIM, generator=g) for _ in range(3))
                chunk_attention(q, k, v, cache, layer, c, commit=p == denoise_passes, capture=capture)
    return cache


def test_capture_records_the_chunk_queries_exact_history_and_earlier_queries(tmp_path):
    cap = TraceCapture(chunks=[3], frame_grid=(2, 4), model="unit")
    cache = _run(cap)
    t = cap.writers[3].layers[1]
    assert t["q"].shape == (HEADS, TPF, DIM) and t["k"].shape == (HEADS, 3 * TPF, DIM)
    assert torch.equal(t["k"], cache.keys(1)[0, :, :3 * TPF]) and torch.equal(t["v"], cache.values(1)[0, :, :3 * TPF])
    assert t["q_hist"].shape == (HEADS, 3 * 2 * TPF, DIM)  # chunks 0-2, denoising and clean passes
    cap.set_frames(torch.rand(4, 4, 8, 3))
    (path,) = cap.save(tmp_path / "t.safetensors")
    tr = read_trace(path)
    assert tr.meta["chunk_frames"] == "1" and tr.meta["model"] == "unit" and tr.frames.shape == (4, 4, 8, 3)
    assert tr.softmax_scale == DIM ** -0.5 and sorted(tr.layers) == [0, 1]


def test_capture_pass_kind_commit_records_the_clean_pass_queries():
    den, com = TraceCapture(chunks=2, layers=0, frame_grid=(2, 4)), TraceCapture(chunks=2, layers=0, pass_kind="commit",
                                                                                  frame_grid=(2, 4))
    _run(den, n_chunks=3), _run(com, n_chunks=3)
    assert list(den.writers[2].layers) == [0]
    assert not torch.equal(den.writers[2].layers[0]["q"], com.writers[2].layers[0]["q"])
    assert torch.equal(den.writers[2].layers[0]["k"], com.writers[2].layers[0]["k"])


def test_capture_budget_skips_layers_that_do_not_fit():
    unit = HEADS * TPF * DIM * 4  # one chunk of one fp32 tensor
    one_layer = 7 * unit  # q, then k and v of the 3 cached chunks
    cap = TraceCapture(chunks=[3], frame_grid=(2, 4), history=False, max_bytes=one_layer)
    _run(cap)
    assert list(cap.writers[3].layers) == [0] and cap.skipped == {3: [1]}
    assert cap.nbytes() <= cap.max_bytes
    small = TraceCapture(chunks=[3], frame_grid=(2, 4), max_bytes=4 * unit)  # history alone would need 6 units
    _run(small)
    assert small.hist_truncated and small.nbytes() <= small.max_bytes and small.skipped == {3: [0, 1]}


def test_capture_of_a_quantized_cache_needs_keep_exact():
    with pytest.raises(ValueError, match="keep_exact"):
        _run(TraceCapture(chunks=[3], frame_grid=(2, 4)), CacheConfig("rtn"))
    cap = TraceCapture(chunks=[3], frame_grid=(2, 4))
    cache = _run(cap, CacheConfig("rtn", keep_exact=True))
    assert torch.equal(cap.writers[3].layers[0]["k"], cache.keys(0, exact=True)[0, :, :3 * TPF])


@pytest.mark.parametrize("kwargs, needle", [(dict(chunks=[0]), "chunk 0 attends"), (dict(chunks=[]), "non-empty"),
                                            (dict(chunks=[1], pass_kind="last"), "pass_kind"),
                                            (dict(chunks=[1], max_bytes=0), "max_bytes"),
                                            (dict(chunks=[1], layers=[-1]), "layers")])
def test_capture_rejects_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        TraceCapture(**kwargs)


def test_capture_save_and_grid_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="frame_grid"):
        _run(TraceCapture(chunks=[1]))
    with pytest.raises(ValueError, match="nothing was captured"):
        TraceCapture(chunks=[9], frame_grid=(2, 4)).save(tmp_path / "x.safetensors")
    cap = TraceCapture(chunks=[1, 2], frame_grid=(2, 4))
    _run(cap)
    with pytest.raises(ValueError, match="chunk"):
        cap.save(tmp_path / "x.safetensors")
    assert len(cap.save(tmp_path / "x{chunk}.safetensors")) == 2
    with pytest.raises(ValueError, match="eviction"):
        _run(TraceCapture(chunks=[3], frame_grid=(2, 4)), CacheConfig("bf16", max_chunks=2))
    with pytest.raises(ValueError, match="batch_index"):
        _run(TraceCapture(chunks=[1], frame_grid=(2, 4), batch_index=1))
