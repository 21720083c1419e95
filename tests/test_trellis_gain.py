"""benchmarks/trellis_gain.py's trace probes (--price, --tails): they commit a trace's Keys as analyze does and print
one row per width or bin, and --price leaves TrellisChannels.code as it found it."""
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trellis_gain as tg  # noqa: E402

from quantwm.core.layouts.trellis import TrellisChannels  # noqa: E402


def _rows(text: str) -> list[list[float]]:
    return [[float(x) for x in re.findall(r"\d+\.\d+(?:e-?\d+)?", line)] for line in text.splitlines()
            if re.match(r"\| \d", line)]


def test_price_prints_a_positive_ratio_per_width_and_restores_the_layout(tiny_trace_path, capsys):
    before = TrellisChannels.__dict__["code"]
    tg.price(tiny_trace_path, 2.5)
    rows = _rows(capsys.readouterr().out)
    assert rows and all(r[0] > 0 for r in rows)  # real trellis error over the grid's
    assert TrellisChannels.__dict__["code"] is before


def test_tails_bins_every_quantized_element(tiny_trace_path, capsys):
    tg.tails(tiny_trace_path, 2.5)
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 5 and all(r[-1] > 0 for r in rows)  # five bins, each with a ratio


def test_state_bits_is_checked(capsys):
    with pytest.raises(SystemExit):
        tg.main(["--state-bits", "10"])  # without --tables
    assert "--state-bits goes with --tables" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--state-bits takes 4-12"):
        tg.main(["--tables", "--state-bits", "16"])


def test_a_trained_table_never_codes_its_training_samples_worse_than_before():
    """--trained's Lloyd iteration on the trellis: the search is optimal for a table and each value the mean of its
    samples is optimal for the paths, so the training error cannot rise from the start, iteration by iteration."""
    import torch

    from quantwm.core import trellis

    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(5))

    def error(table):
        return (table[trellis.viterbi(x, 2, table, states=True)] - x).square().mean().item()

    errors = [error(tg.trained_table(x, 2, 5, seed=1, iterations=n)) for n in (0, 1, 3, 6)]
    assert all(b <= a + 1e-6 for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.9 * errors[0]  # the shuffled quantiles are a poor start; training must move them
    with pytest.raises(SystemExit, match="--restarts takes 1 or more"):
        tg.trained_tables(0)


def _coded(r, bits):
    t = TrellisChannels.code(r, bits, alpha=torch.ones(bits.shape))
    return t, t.decode()


def test_the_probe_with_the_stored_codebook_changes_nothing(monkeypatch):
    """--probe's patches with the stored codebook (`stored`) code and decode a span bit for bit as the library."""
    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    g = torch.Generator().manual_seed(2)
    r, bits = torch.randn(2, 60, 9, generator=g) * 2 + 1, torch.arange(9).repeat(2, 1)
    plain, decoded = _coded(r, bits)
    with tg.stored_tables(None, 4):
        patched, again = _coded(r, bits)
    assert torch.equal(plain.codes, patched.codes) and torch.equal(decoded, again)
    assert torch.equal(plain.step_, patched.step_) and torch.equal(plain.on_grid, patched.on_grid)


def test_the_probe_decodes_through_the_trained_tables(monkeypatch, tmp_path):
    """With a tables file, a width-k trellis channel decodes to its mean plus its stored deviation times a value of
    its width's table (read by the top k + m bits of the state), and the patches are undone on leaving."""
    import json

    from quantwm.core import trellis

    monkeypatch.setenv("QUANTWM_KERNELS", "ref")
    g = torch.Generator().manual_seed(3)
    small = {f"{k},3": (torch.randn(1 << (k + 3), generator=g)).tolist() for k in tg.TRAINED_WIDTHS}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tables": small}))
    r = torch.randn(1, 80, 4, generator=g)
    bits = torch.tensor([[1, 2, 3, 4]])
    with tg.stored_tables(str(path), 3):
        t = TrellisChannels.code(r, bits)
        decoded = t.decode()
    assert trellis.scale_of.__module__ == "quantwm.core.trellis"  # restored
    for d, k in enumerate(bits[0].tolist()):
        values = torch.tensor(small[f"{k},3"])
        unit = (decoded[0, :, d] - t.low[0, d].float()) / t.step_[0, d].float()
        assert (unit[:, None] - values[None]).abs().amin(1).max() < 1e-3, k
    with pytest.raises(SystemExit, match="no table of 32 values for width 1 and memory 4"):
        tg.stored_tables(str(path), 4)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="not a tables file"):
        tg.stored_tables(str(bad), 3)
    with pytest.raises(SystemExit, match="not a tables file"):
        tg.on_laplace(str(tmp_path / "missing.json"))


def test_the_heavier_tailed_source_and_the_training_options_are_checked(capsys):
    """--laplace's source has unit variance and a Laplacian's kurtosis (6, against the Gaussian's 3); --trained's
    options are refused alone or out of range."""
    x = tg.laplacian(4, 20000, 3).double()
    assert abs(x.var().item() - 1) < 0.05 and 5 < ((x - x.mean()) ** 4).mean().item() / x.var().item() ** 2 < 7
    with pytest.raises(SystemExit):
        tg.main(["--source", "mixture"])
    assert "go with --trained" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--source takes gauss or mixture"):
        tg.trained_tables(1, None, "student", (2,))
    with pytest.raises(SystemExit, match="a subset of"):
        tg.trained_tables(1, None, "gauss", (5,))


def test_the_formats_tables_module_is_what_emit_writes_from_the_saved_tables(tmp_path, capsys):
    """kernels/trellis_tables.py is generated: --emit from the committed JSON writes its values as they are (all but
    the docstring, which names the output path); a file short of a width's table is a clear exit."""
    import json

    out = tmp_path / "tables.py"
    tg.main(["--emit", str(ROOT / "docs/frontier/trellis-tables-mixture.json"), "4", str(out)])
    assert "wrote" in capsys.readouterr().out
    body = lambda text: text.split('"""', 2)[2]
    assert body(out.read_text()) == body((ROOT / "kernels/trellis_tables.py").read_text())
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"tables": {"1,4": [0.0] * 32}}))
    with pytest.raises(SystemExit, match="no table of 64 values for width 2 and memory 4"):
        tg.emit(str(short), 4, str(out))
    with pytest.raises(SystemExit):
        tg.main(["--emit", str(short), "5", str(out)])
