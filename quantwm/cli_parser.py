"""The `quantwm` command line's parser: every sub-command and its flags, each sub-command's added by its own
`_add_<command>` (the commands run in quantwm.cli and the `cli_*` modules beside it).

Flags several sub-commands share are defined once, as argparse parents: what is quantized (`--method` or
`--methods`, `--target`, `--bits`), the budget (`--budget`, `--budget-k`, `--budget-v`), `--json`, `--weights` and
`--set`. A parent whose default differs between commands is made by a function that takes the default.
"""
from __future__ import annotations

import argparse
import sys

from .core.cache_types import TARGETS
from .evaluation.figures import FIGURE_KINDS
from .evaluation.memory import PRESETS
from .evaluation.synthetic import KINDS
from .world.scene import WORLDS


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise SystemExit(fail(f"{self.prog}: {message}"))


def fail(message: str) -> int:
    print(f"quantwm: error: {message}", file=sys.stderr)
    return 2


def add_budget(s) -> None:
    """--budget / --budget-k / --budget-v: bits per element (docs/method.md §3.1)."""
    s.add_argument("--budget", type=float, help="bits per element (stored bytes) for Keys and Values: every method "
                                                "configures itself within it by its own rule, or is left out")
    s.add_argument("--budget-k", type=float, help="the Keys' budget apart (default: --budget)")
    s.add_argument("--budget-v", type=float, help="the Values' budget apart (default: --budget)")


COMPARED = "rtn,kivi,qvg,quantwm"  # --methods' default where methods are compared


def _flag(*names: str, **kwargs) -> argparse.ArgumentParser:
    """A parent parser holding one flag."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(*names, **kwargs)
    return p


def method_flag() -> argparse.ArgumentParser:
    """--method: the one method a command runs (a registry name, `quantwm methods`)."""
    return _flag("--method", default="quantwm")


def methods_flag(default: str = COMPARED, help: str | None = None) -> argparse.ArgumentParser:
    """--methods: the comma-separated methods a command compares."""
    return _flag("--methods", default=default, help=help)


def target_flag(default: str = "kv") -> argparse.ArgumentParser:
    """--target: which halves are quantized, one of `TARGETS`."""
    return _flag("--target", choices=TARGETS, default=default)


def bits_flag(default: int | str = 2) -> argparse.ArgumentParser:
    """--bits: bits of the codes; a string default means a comma-separated list of them (a sweep)."""
    return _flag("--bits", type=int if isinstance(default, int) else None, default=default)


def budget_flags() -> argparse.ArgumentParser:
    """--budget / --budget-k / --budget-v (`add_budget`) as a parent parser."""
    p = argparse.ArgumentParser(add_help=False)
    add_budget(p)
    return p


def json_flag() -> argparse.ArgumentParser:
    """--json: where a command also writes its report."""
    return _flag("--json", help="also write the report as JSON here")


def weights_flag() -> argparse.ArgumentParser:
    """--weights: the built-in world model's weights."""
    return _flag("--weights", help="world-model weights (default: the built-in model, shipped with the package)")


def set_flag() -> argparse.ArgumentParser:
    """--set KEY=VALUE: a method option for every method (repeatable)."""
    return _flag("--set", action="append", metavar="KEY=VALUE",
                 help="method option for every method, e.g. --set lam=4 or --set qsac=false (repeatable)")


def _add_analyze(sub) -> None:
    """`quantwm analyze`: its sub-parser and flags."""
    s = sub.add_parser("analyze", help="attention fidelity of methods on a trace file",
                       parents=[methods_flag(), target_flag("k"), bits_flag(), set_flag(), budget_flags(), json_flag()])
    s.add_argument("--trace", required=True)
    s.add_argument("--chunk-frames", type=int, default=None, help="frames per chunk (default: the trace's, else 1)")
    s.add_argument("--sink-chunks", type=int, default=1)
    s.add_argument("--recent-chunks", type=int, default=1)


def _add_memory(sub) -> None:
    """`quantwm memory`: its sub-parser and flags."""
    s = sub.add_parser("memory", help="stored bytes of the cache at a real model's shapes",
                       parents=[method_flag(), target_flag(), bits_flag(), budget_flags(), json_flag()])
    s.add_argument("--preset", default="wan-1.3b",
                   help=f"shapes: {', '.join(PRESETS)}, causal-forcing; the QuantWM paper's five models carry their "
                        "window and length as FastVideo 0.2.1 runs them (docs/results.md)")
    s.add_argument("--latent-frames", type=int, default=None,
                   help="video length in latent frames (default: the preset's paper length, else 21)")
    s.add_argument("--recent-chunks", type=int, default=None,
                   help="most recent committed chunks kept BF16 (default: the preset's adapter's, else 1)")
    s.add_argument("--sample-layers", type=int, default=None, help="quantize this many layers and scale")
    s.add_argument("--span-chunks", type=int, default=1, help="chunks quantized together as one span (QVG: 8)")
    s.add_argument("--queries", choices=("drift", "none"), default="drift",
                   help="drift: a synthetic query stream whose subspace moves (as deployed); none: S stays identity")


def _add_plan(sub) -> None:
    """`quantwm plan`: its sub-parser and flags."""
    s = sub.add_parser("plan", help="bits per element a rollout or window needs to fit a memory limit, frames that "
                                    "fit, and the quality the frontier measured at that budget", parents=[json_flag()])
    s.add_argument("--model", default="wan-1.3b", help=f"shape preset: {', '.join(PRESETS)}")
    for flag in ("layers", "heads", "head-dim", "tokens-per-frame", "chunk-frames"):
        s.add_argument(f"--{flag}", type=int, default=None, help=f"{flag.replace('-', ' ')} (overrides --model)")
    length = s.add_mutually_exclusive_group(required=True)
    length.add_argument("--frames", type=int, help="rollout length in video frames (81: 21 latent frames)")
    length.add_argument("--latent-frames", type=int, help="rollout length in latent frames")
    s.add_argument("--window", type=int, default=None,
                   help="rolling window: the sink plus this many most recent chunks (default: the whole rollout)")
    s.add_argument("--sink-chunks", type=int, default=1)
    s.add_argument("--recent-chunks", type=int, default=1, help="most recent committed chunks kept BF16")
    s.add_argument("--memory-gb", type=float, required=True, help="memory limit for the KV cache, GiB")
    s.add_argument("--frontier", default=None, help="frontier file whose envelope gives the quality figures "
                                                   "(default: docs/frontier/world.json of this checkout)")


def _add_synth_trace(sub) -> None:
    """`quantwm synth-trace`: its sub-parser and flags."""
    s = sub.add_parser("synth-trace", help="write the synthetic world-memory trace")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--heads", type=int, default=8)
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--query-dims", type=int, default=8,
                   help="dimension of the query subspace: 8 / 12 / 22 give ~97%% / ~71%% / ~45%% top-8 energy")
    s.add_argument("--kind", choices=KINDS, default="aligned",
                   help="how the heads' channels carry the world: aligned (query energy on the slow RoPE channels), "
                        "flat, rotated, norope, outliers (quantwm/evaluation/synthetic.py)")
    s.add_argument("--grid", default="12x16", help="tokens per frame as ROWSxCOLS (Wan-1.3B at 480p: 30x52)")
    s.add_argument("--chunk-frames", type=int, default=3, help="frames per chunk: a span holds grid x this many tokens")
    s.add_argument("--cached-frames", type=int, default=24, help="frames in the cache (a multiple of --chunk-frames)")
    s.add_argument("--out", required=True)


def _add_eval(sub) -> None:
    """`quantwm eval`: its sub-parser and flags."""
    s = sub.add_parser("eval", help="BF16 vs methods on the built-in world model",
                       parents=[methods_flag(), target_flag(), bits_flag(), set_flag(), weights_flag(), budget_flags(),
                                json_flag()])
    s.add_argument("--seeds", default="0,1,2,3")
    s.add_argument("--frames", type=int, default=32)
    s.add_argument("--trajectory", default="loop")
    s.add_argument("--steps", type=int, default=4, help="flow-matching steps per chunk")
    s.add_argument("--training-seeds", action="store_true",
                   help="use training worlds (seed + 100000) instead of held-out ones, to check memorisation")
    s.add_argument("--training-photos", nargs="?", const="all", choices=("all", "matched"), default=None,
                   help="the same worlds' layouts, trajectories and noise with tiles from the training photographs "
                        "(each held-out world against its twin: the paired memorisation check); 'matched': one "
                        "per held-out scene, of the same kind (grey or colour), so tiles repeat a photograph where the "
                        "held-out world's repeat a scene")
    s.add_argument("--world", choices=WORLDS, default="photo", help="world kind (photo: mosaics of photographs; place: one "
                   "held-out photograph, no tiles; procedural: the first models' world)")
    s.add_argument("--window", type=int, default=None,
                   help="rolling window: the sink chunks plus this many most recent chunks (whole-chunk eviction); "
                        "the run streams frame by frame (frames in the hundreds)")
    s.add_argument("--sink-chunks", type=int, default=1, help="with --window: chunks kept at the start")
    s.add_argument("--stream", default=None, help="with --window: write one JSON line per generated frame here")
    s.add_argument("--threshold-db", type=float, default=30.0,
                   help="with --window: a frame leaves BF16 when its PSNR against BF16 falls below this")
    s.add_argument("--figure", default=None, metavar="STEM",
                   help="with --window: save the error-over-time curves as STEM.png and STEM.svg; with "
                        "--layer-sensitivity: the layer-sensitivity table of each method")
    s.add_argument("--layer-sensitivity", action="store_true",
                   help="also, per method: one layer at a time quantized (the rest BF16) and one layer at a time kept "
                        "BF16 (the rest quantized), and the bits the method gave each (layer, head); 2 L + 2 more "
                        "rollouts per seed (quantwm/world/sensitivity.py)")


def _add_trace(sub) -> None:
    """`quantwm trace`: its sub-parser and flags."""
    s = sub.add_parser("trace", help="write a trace file from the built-in world model", parents=[weights_flag()])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--frames", type=int, default=32)
    s.add_argument("--trajectory", default="loop")
    s.add_argument("--world", choices=WORLDS, default="photo")
    s.add_argument("--out", required=True)


def _add_record(sub) -> None:
    """`quantwm record`: its sub-parser and flags."""
    s = sub.add_parser("record", help="write a run file (BF16 and a method from the same noise) for the app",
                       parents=[method_flag(), target_flag()])
    s.add_argument("--bits", type=int, default=None,
                   help="bits of the codes (default 2; with --pipeline and no --budget either: --budget 2.5, which "
                        "fits every head dim)")
    s.add_argument("--pipeline", default=None, metavar="fastvideo:NAME",
                   help="a world model of the QuantWM paper run through FastVideo's own model code: fastvideo:NAME for "
                        "NAME in lingbot-world-v2, matrix-game-2, hy-world-1.5, longcat-video, self-forcing "
                        "(causal-forcing); with --tiny (a randomly initialised model of FastVideo's class) or --weights "
                        "DIR (a FastVideo model folder); --frames counts latent frames (docs/real-models.md)")
    s.add_argument("--tiny", action="store_true", help="with --pipeline: a tiny randomly initialised model")
    s.add_argument("--inputs", default=None, metavar="FILE",
                   help="with --pipeline: a safetensors file of conditioning tensors (the prompt's embeddings, the first "
                        "frame's latents, the camera...) by the model's input names, in place of the ones drawn from "
                        "--seed (docs/real-models.md lists each model's)")
    s.add_argument("--model", choices=("builtin", "self-forcing", "sana-wm"), default="builtin",
                   help="builtin: the built-in world model; self-forcing: Self-Forcing's causal Wan2.1 generator "
                        "(--checkpoint, --base, --embeddings or --prompt); sana-wm: SANA-WM's stage-2 refiner, "
                        "diffusers' SanaWMLTX2Refiner (--base, --latents, --prompt)")
    s.add_argument("--seed", type=int, default=0, help="world seed (builtin: 0..99999) or noise seed")
    s.add_argument("--trajectory", default="loop")
    s.add_argument("--frames", type=int, default=None,
                   help="frames (builtin: 32); with --pipeline: latent frames (default: the model's tiny run)")
    s.add_argument("--budget", type=float, default=None,
                   help="builtin and --pipeline: bits per element; the method configures itself within it "
                        "(replaces --bits)")
    s.add_argument("--window", type=int, default=None,
                   help="builtin: a rolling window of the sink chunks plus this many most recent chunks; the file is "
                        "written chunk by chunk, so frames in the hundreds take the window's memory "
                        "(quantwm/drivers/long_record.py)")
    s.add_argument("--sink-chunks", type=int, default=1, help="with --window: chunks kept at the start")
    s.add_argument("--sensitivity-frames", type=int, default=None, metavar="N",
                   help="with --window: also store the layer sensitivity of the method over N frames of the same "
                        "world (2 L + 2 short rollouts), for the app's layer table")
    s.add_argument("--logit-layers", default="1", help="layers whose attention logits the file keeps (size bound)")
    s.add_argument("--logit-heads", default="0", help="heads whose attention logits the file keeps")
    s.add_argument("--weights", help="builtin: world-model weights (default: the built-in model); --pipeline: a FastVideo "
                                     "model folder (transformer/config.json and *.safetensors)")
    s.add_argument("--checkpoint", help="self-forcing: the released generator checkpoint (.pt, original Wan names)")
    s.add_argument("--base", help="self-forcing: a local diffusers Wan2.1 folder (transformer/config.json, vae/); "
                                  "sana-wm: a SanaWMLTX2Refiner folder saved with its vae")
    s.add_argument("--embeddings", help="self-forcing: a safetensors file with the prompt's UMT5 prompt_embeds")
    s.add_argument("--latents", help="sana-wm: a safetensors file with the stage-1 `latents` (1, C, F, H, W)")
    s.add_argument("--kv-max-frames", type=int, default=11,
                   help="sana-wm: sink plus recent latent frames the refiner's window keeps (its default: 11)")
    s.add_argument("--prompt", help="the prompt (self-forcing: encoded by the base model's UMT5, base/tokenizer and "
                                    "base/text_encoder; sana-wm: by the refiner's Gemma-3; needs transformers)")
    s.add_argument("--latent-frames", type=int, default=21, help="self-forcing: latent frames (21: 81 video frames)")
    s.add_argument("--chunk-frames", type=int, default=3, help="self-forcing: latent frames per chunk")
    s.add_argument("--height", type=int, default=480)
    s.add_argument("--width", type=int, default=832)
    s.add_argument("--device", default="cpu", help="self-forcing: cpu or cuda (cuda uses the fused kernels)")
    s.add_argument("--out", required=True)


def _add_figures(sub) -> None:
    """`quantwm figures`: its sub-parser and flags."""
    s = sub.add_parser("figures", help="print figures (PNG/PDF/SVG, matplotlib) of a built-in-model run",
                       parents=[method_flag(), target_flag(), bits_flag(), weights_flag(),
                                methods_flag(help="methods of the comparison figure ('' = none)")])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--trajectory", default="loop")
    s.add_argument("--frames", type=int, default=32)
    s.add_argument("--frame", type=int, default=None, help="frame of the maps and the pixel trace (default: the worst)")
    s.add_argument("--pixel", default=None, help="x,y of the traced pixel in frame pixels (default: the centre)")
    s.add_argument("--layer", type=int, default=1)
    s.add_argument("--head", type=int, default=0)
    s.add_argument("--kinds", default=",".join(FIGURE_KINDS), help=f"which figures ({', '.join(FIGURE_KINDS)})")
    s.add_argument("--formats", default="png,pdf,svg")
    s.add_argument("--out-dir", required=True)


def _add_frontier(sub) -> None:
    """`quantwm frontier`: its sub-parser and flags."""
    s = sub.add_parser("frontier", help="quality vs bits per element for every method (resumable sweep)",
                       parents=[methods_flag("", help="methods to sweep (default: all with a sweep)"), target_flag(),
                                bits_flag("2,3,4")])
    s.add_argument("--sources", default="world", help="comma-separated: world and/or trace:FILE")
    s.add_argument("--seeds", default="0,1", help="held-out world seeds of the world source")
    s.add_argument("--frames", type=int, default=16)
    s.add_argument("--quick", action="store_true", help="one point per method (a smoke test)")
    s.add_argument("--budget", default="", help="comma-separated bits per element: one point per method and budget, "
                                                "each configured by its budget rule (instead of the sweep)")
    s.add_argument("--max-bits", type=float, default=None,
                   help="skip sweep points that store more bits per element than this (they cannot enter an "
                        "envelope up to it); e.g. 4")
    s.add_argument("--workers", type=int, default=1, help="local worker processes")
    s.add_argument("--ray", default=None, metavar="ADDRESS", help="run the points on a Ray cluster ('local': start one)")
    s.add_argument("--formats", default="png,svg")
    s.add_argument("--out-dir", required=True)


def _add_query_stats(sub) -> None:
    """`quantwm query-stats`: its sub-parser and flags."""
    s = sub.add_parser("query-stats", help="a calibration file of query statistics (S per layer) from a trace, for "
                                           "the SGLang plugin's QUANTWM_KV_QUERY_STATS")
    s.add_argument("--trace", required=True)
    s.add_argument("--out", required=True)


def _add_methods(sub) -> None:
    """`quantwm methods`: its sub-parser and flags."""
    sub.add_parser("methods", help="list the registered methods")


def _add_selfcheck(sub) -> None:
    """`quantwm selfcheck`: its sub-parser and flags."""
    s = sub.add_parser("selfcheck", help="on this machine: the device, which path each method takes, every kernel "
                                         "checked against its reference (exit 1 if one fails), and a timing table",
                       parents=[method_flag(), json_flag()])
    s.add_argument("--model", choices=["wan-1.3b", "wan-14b", "tiny"], default=None,
                   help="shapes to time (default: wan-1.3b on a GPU, tiny on a CPU)")
    s.add_argument("--heads", type=int, default=None, help="attention heads (overrides --model)")
    s.add_argument("--head-dim", type=int, default=None, help="head dim (overrides --model)")
    s.add_argument("--chunk-tokens", type=int, default=None, help="tokens of a chunk (overrides --model)")
    s.add_argument("--lengths", default=None, help="cached tokens to time at, e.g. 8192,32768 (overrides --model)")
    s.add_argument("--budget", type=float, default=None, help="bits per element of the timed method")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="quantwm", description="2-bit KV-cache quantization for video world models")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (_add_analyze, _add_memory, _add_plan, _add_synth_trace, _add_eval, _add_trace, _add_record,
                _add_figures, _add_frontier, _add_query_stats, _add_methods, _add_selfcheck):  # `--help`'s order
        add(sub)
    sub.add_parser("app", help="start the diagnostics app (options: quantwm app --help)", add_help=False)
    return p
