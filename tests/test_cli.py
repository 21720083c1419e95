import json
import subprocess
import sys

import pytest

from quantwm.cli import main
from quantwm.cli_parser import build_parser
from quantwm.core.cache_types import TARGETS


@pytest.fixture(scope="module")
def trace_file(small_trace_path):
    return small_trace_path


def test_cli_analyze_writes_the_documented_json(trace_file, tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(["analyze", "--trace", str(trace_file), "--methods", "rtn,qvg+jensen", "--target", "k",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["methods"]) == {"rtn", "qvg+jensen"}
    assert {"shift_rate", "topk_overlap", "attn_kl", "logit_rmse", "k_rel_err", "v_rel_err", "out_rel_err",
            "bits_per_element", "k_bits_per_element", "k_bits_above_bound", "k_distortion",
            "k_bound_distortion"} <= set(r["methods"]["rtn"]["mean"])
    printed = capsys.readouterr().out
    assert "| rtn" in printed and "Keys against the Gaussian rate-distortion bound" in printed
    assert "| k_bits_above_bound |" in printed


def test_cli_memory_json_fields(tmp_path):
    out = tmp_path / "m.json"
    assert main(["memory", "--preset", "tiny", "--latent-frames", "8", "--method", "rtn", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bits_per_element"] == pytest.approx(2.5)
    assert r["compression"] == pytest.approx(6.4)
    assert 1 < r["cache_compression"] < r["compression"]
    assert {"k.codes", "k.scales", "k.zeros", "k.full"} <= set(r["bytes"])


SHARED_FLAG_DEFAULTS = [
    (["analyze", "--trace", "t"], {"methods": "rtn,kivi,qvg,quantwm", "target": "k", "bits": 2}),
    (["memory"], {"method": "quantwm", "target": "kv", "bits": 2}),
    (["eval"], {"methods": "rtn,kivi,qvg,quantwm", "target": "kv", "bits": 2}),
    (["record", "--out", "o"], {"method": "quantwm", "target": "kv", "bits": None}),  # 2, or --budget 2.5 with --pipeline
    (["figures", "--out-dir", "o"], {"method": "quantwm", "methods": "rtn,kivi,qvg,quantwm", "target": "kv", "bits": 2}),
    (["frontier", "--out-dir", "o"], {"methods": "", "target": "kv", "bits": "2,3,4"}),
]


@pytest.mark.parametrize("argv, defaults", SHARED_FLAG_DEFAULTS, ids=[argv[0] for argv, _ in SHARED_FLAG_DEFAULTS])
def test_cli_shared_flags_keep_each_commands_defaults(argv, defaults):
    """--method(s), --target and --bits come from parent parsers; each command keeps its own defaults."""
    args = vars(build_parser().parse_args(argv))
    assert {k: args[k] for k in defaults} == defaults
    for target in TARGETS:
        assert build_parser().parse_args([*argv, "--target", target]).target == target


@pytest.mark.parametrize("argv, needle", [
    (["analyze", "--trace", "/nonexistent.safetensors"], "no such trace file"),
    (["analyze", "--trace", "{trace}", "--methods", "nope"], "unknown method"),
    (["analyze", "--trace", "{garbage}"], "not a valid QuantWM trace"),
    (["analyze", "--trace", "{trace}", "--target", "x"], "invalid choice"),
    (["memory", "--preset", "nope"], "unknown preset"),
    (["memory", "--preset", "tiny", "--bits", "5"], "unsupported bits"),
    (["memory", "--preset", "tiny", "--latent-frames", "zero"], "invalid int"),
    (["synth-trace", "--kind", "skewed", "--out", "{garbage}"], "invalid choice"),
    (["frobnicate"], "invalid choice"),
])
def test_cli_errors_are_one_line_exit_2(argv, needle, trace_file, tmp_path, capsys):
    """`main`, which `python -m quantwm` runs (the next test runs the command itself)."""
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"garbage")
    argv = [a.format(trace=trace_file, garbage=garbage) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # the parser's errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [(["memory", "--preset", "nope"], "unknown preset"),
                                          (["frobnicate"], "invalid choice")])
def test_the_command_exits_2_with_one_line(argv, needle):
    p = subprocess.run([sys.executable, "-m", "quantwm", *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr


def test_cli_synth_trace_kind_reaches_the_trace_and_analyze(tmp_path, capsys):
    from quantwm.evaluation.trace import read_trace

    assert build_parser().parse_args(["synth-trace", "--out", "o"]).kind == "aligned"
    out = tmp_path / "rotated.safetensors"
    assert main(["synth-trace", "--seed", "100001", "--kind", "rotated", "--layers", "1", "--heads", "1",
                 "--head-dim", "64", "--grid", "4x4", "--cached-frames", "6", "--out", str(out)]) == 0
    assert read_trace(out).meta["kind"] == "rotated"
    assert main(["analyze", "--trace", str(out), "--methods", "rtn"]) == 0
    assert "kind rotated" in capsys.readouterr().out


def test_cli_set_passes_method_options(trace_file, tmp_path):
    out = tmp_path / "a.json"
    assert main(["analyze", "--trace", str(trace_file), "--methods", "quantwm-qsac", "--set", "lam=0",
                 "--set", "candidates=none", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["config"]["method_options"] == {"lam": 0, "candidates": None}
    assert "lambda=0" in r["config"]["grid"]["quantwm-qsac"]
    assert main(["analyze", "--trace", str(trace_file), "--methods", "rtn", "--set", "nonsense"]) == 2
    assert main(["analyze", "--trace", str(trace_file), "--methods", "rtn", "--set", "frobnicate=1"]) == 2


def test_cli_methods_lists_each_method_with_its_source(capsys):
    assert main(["methods"]) == 0
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "method" not in line}
    assert rows["oscar"] == ["bits", "arXiv 2605.17757; code github.com/FutureMLS-Lab/OSCAR (read at 473ff3f; also in its "
                                     "SGLang fork)"]
    for name, paper in (("turboquant", "2504.19874"), ("kivi", "2402.02750"), ("qvg", "2602.02958")):
        assert f"arXiv {paper}" in rows[name][1]
    assert "this project" in rows["span-rtn"][1] and rows["nvfp4"][0] == "fixed"


def test_cli_memory_paper_preset_prints_its_source_window_and_length(capsys):
    assert main(["memory", "--preset", "matrix-game-2", "--method", "bf16", "--sample-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "matrix-game-2, 15 latent frames" in out  # its length by default
    assert "window 6 latent frames" in out and "holds 6 latent frame(s)" in out
    assert "source: fastvideo 0.2.1: fastvideo/configs/models/dits/matrixgame2.py" in out
