"""Self-Forcing recording on tiny random models of the real classes, saved in the real checkpoint formats:
the generator as a torch checkpoint in the original Wan parameter names ("generator_ema", "model." prefix),
loaded through diffusers' single-file conversion; a diffusers Wan folder (transformer config, AutoencoderKLWan)."""
import re

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from quantwm.adapters.self_forcing import SelfForcingLive, load_self_forcing, record_self_forcing, sigmas  # noqa: E402
from quantwm.drivers.registry import RunRegistry  # noqa: E402
from quantwm.drivers.workbench import Workbench  # noqa: E402
from quantwm.evaluation.runfile import read_run, write_run  # noqa: E402

LATENT_FRAMES, HEIGHT, WIDTH = 12, 32, 64  # 4 chunks of 3 latent frames; latent 4x8, tokens 2x4 per frame

# diffusers name -> original Wan name (the inverse of diffusers' convert_wan_transformer_to_diffusers)
TO_ORIGINAL = [("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
               ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
               ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
               ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
               ("condition_embedder.time_proj", "time_projection.1"), ("attn2", "cross_attn"), ("attn1", "self_attn"),
               (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
               ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), ("proj_out", "head.head")]


def to_original_wan_names(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        o = k
        for a, b in TO_ORIGINAL:
            o = o.replace(a, b)
        o = re.sub(r"^scale_shift_table$", "head.modulation", o)
        o = re.sub(r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation", o)
        o = o.replace("norm2", "norm__x").replace("norm3", "norm2").replace("norm__x", "norm3")
        out[o] = v
    return out


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(checkpoint, base, embeddings, the diffusers model the checkpoint was made from)."""
    from safetensors.torch import save_file
    from tiny_wan import tiny_wan

    model, vae = tiny_wan(latents_mean=0.1, latents_std=1.5)
    root = tmp_path_factory.mktemp("self_forcing")
    base = root / "Wan2.1-T2V-tiny-Diffusers"
    model.save_config(base / "transformer")
    vae.save_pretrained(base / "vae")
    ckpt = root / "self_forcing_dmd.pt"
    torch.save({"generator_ema": {f"model.{k}": v for k, v in to_original_wan_names(model.state_dict()).items()}}, ckpt)
    emb = root / "prompt.safetensors"
    save_file({"prompt_embeds": torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(5))}, str(emb))
    return ckpt, base, emb, model


def test_the_checkpoint_loads_through_diffusers_single_file_conversion(released):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    ckpt, base, _, model = released
    original = to_original_wan_names(model.state_dict())
    assert "head.modulation" in original and "blocks.0.self_attn.q.weight" in original
    assert set(convert_wan_transformer_to_diffusers(dict(original))) == set(model.state_dict())  # a true inverse
    loaded, vae = load_self_forcing(ckpt, base)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert 2 ** len(vae.temperal_downsample) == 8 and 2 ** sum(vae.temperal_downsample) == 4


def test_few_step_schedule_is_self_forcings():
    s = sigmas()
    assert s[0] == 1.0 and s == sorted(s, reverse=True) and s[-1] == pytest.approx(5 * 0.25 / (1 + 4 * 0.25))


@pytest.fixture(scope="module")
def recorded(released, tmp_path_factory):
    ckpt, base, emb, _ = released
    run = record_self_forcing(ckpt, base, emb, method="quantwm", latent_frames=LATENT_FRAMES, height=HEIGHT,
                              width=WIDTH, logit_layers=[1], logit_heads=[0, 1])
    path = tmp_path_factory.mktemp("sf_run") / "sf.safetensors"
    write_run(path, run)
    return run, path


def test_a_self_forcing_run_records_both_generations_with_probes(recorded):
    run, path = recorded
    back = read_run(path)
    f = back.facts
    assert f.latent_grid == (2, 4) and f.pixels_per_token == 16 and f.vae_temporal == 4 and f.chunk_frames == 3
    assert back.bf16.shape == (f.output_frames(LATENT_FRAMES), HEIGHT, WIDTH, 3) == (45, 32, 64, 3)
    assert sorted(back.top1) == [1, 2, 3] and back.top1[3][0].shape == (2, 2, 24)
    assert back.logits[3][0].shape == (1, 2, 24, 72)
    assert not torch.equal(back.bf16, back.method)  # the 2-bit cache changed the video
    assert back.meta["bits_per_element"] < 16 and back.meta["memory_mb"]["stored"] < back.meta["memory_mb"]["bf16"]
    # the top-1 sources are the argmax of the logits kept for them (layer 1)
    e, q = back.top1[2]
    le, lq = back.logits[2]
    picked = le[0].gather(-1, e[1][..., None].long())[..., 0]  # logits kept in fp16: ties within 1e-2
    assert (le[0].max(-1).values - picked).abs().max() < 1e-2


def test_the_app_views_map_output_pixels_to_latent_tokens(recorded):
    _, path = recorded
    runs = RunRegistry(Workbench())
    lr = runs.view(runs.open(str(path)))
    cmp = lr.compare()
    assert len(cmp["series"]["psnr"]) == 45 and cmp["summary"]["span_bits_per_element"] < 16
    v = lr.frame_view(44, None, None)
    assert v["jumps"].shape == (2, 4) and v["bf16"].shape == (32, 64, 3)
    assert lr.frame_view(3)["jumps"] is None  # latent frame 1: chunk 0, not probed
    tr = lr.pixel_trace(44, 63, 31, 1, 1)  # output frame 44 = latent frame 11; pixel -> token (1, 3)
    assert tr["query"] == (11, 1, 3) and tr["logits_bf16"].shape == (9, 8)
    assert tr["frames"].shape == (12, 32, 64, 3)  # one thumbnail per latent frame
    f, r, c = tr["source_bf16"]
    assert tr["logits_bf16"][f, r * 4 + c] == pytest.approx(tr["logits_bf16"].max(), abs=1e-2)
    with pytest.raises(ValueError, match="outside the 64x32 frame"):
        lr.pixel_trace(44, 64, 0, 1, 0)
    assert np.isfinite(lr.energy()[0]["eigenvalues"]).all()


def test_bad_inputs_are_refused(released, tmp_path):
    ckpt, base, emb, _ = released
    with pytest.raises(ValueError, match="no such checkpoint"):
        load_self_forcing(tmp_path / "none.pt", base)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="unreadable checkpoint"):
        load_self_forcing(tmp_path / "junk.pt", base)
    with pytest.raises(ValueError, match="not a diffusers Wan folder"):
        load_self_forcing(ckpt, tmp_path)
    with pytest.raises(ValueError, match="multiples of 16"):
        record_self_forcing(ckpt, base, emb, latent_frames=6, height=40, width=64)
    with pytest.raises(ValueError, match="no CUDA" if not torch.cuda.is_available() else "."):
        if torch.cuda.is_available():
            raise ValueError("skip: CUDA present")
        record_self_forcing(ckpt, base, emb, device="cuda")


def test_quantwm_record_self_forcing_from_the_command_line(released, tmp_path, capsys):
    from quantwm.cli import main

    ckpt, base, emb, _ = released
    out = tmp_path / "cli.safetensors"
    assert main(["record", "--model", "self-forcing", "--checkpoint", str(ckpt), "--base", str(base), "--embeddings",
                 str(emb), "--latent-frames", "6", "--height", "32", "--width", "64", "--method", "kivi",
                 "--out", str(out)]) == 0
    assert read_run(out).meta["method"] == "kivi" and "Self-Forcing" in capsys.readouterr().out
    assert main(["record", "--model", "self-forcing", "--out", str(out)]) == 2
    assert "needs --checkpoint, --base, --embeddings or --prompt" in capsys.readouterr().err


def save_tiny_umt5(base, text_dim: int = 16) -> None:
    """The base folder's text side as diffusers' Wan folders hold it: tokenizer/ and text_encoder/ (UMT5)."""
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(7)
    UMT5EncoderModel(UMT5Config(d_model=text_dim, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=64,
                                relative_attention_num_buckets=8)).save_pretrained(base / "text_encoder")
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]  # a unigram vocabulary, as UMT5's sentencepiece is
    pieces += [("\u2581" + w, -1.0 - i) for i, w in enumerate("a red car drives at night".split())]
    T5TokenizerFast(vocab=pieces, extra_ids=0).save_pretrained(base / "tokenizer")


def test_a_prompt_is_encoded_by_the_base_models_umt5_as_wans_pipeline_does(released, tmp_path, capsys):
    import shutil

    from safetensors.torch import save_file
    from transformers import UMT5EncoderModel

    from quantwm.adapters.self_forcing import encode_prompt
    from quantwm.cli import main

    ckpt, shared, _, _ = released  # a copy without the text encoder another test may have saved into it
    base = shutil.copytree(shared, tmp_path / "base", ignore=shutil.ignore_patterns("tokenizer", "text_encoder"))
    with pytest.raises(ValueError, match="no tokenizer/ folder"):
        encode_prompt(base, "a red car")
    save_tiny_umt5(base)
    embeds = encode_prompt(base, "a red car")
    assert embeds.shape == (1, 512, 16) and embeds[0, 4:].abs().max() == 0  # "a red car" + </s>, then zeros
    encoder = UMT5EncoderModel.from_pretrained(base / "text_encoder")
    with torch.no_grad():
        direct = encoder(torch.tensor([[3, 4, 5, 1]])).last_hidden_state
    assert torch.allclose(embeds[:, :4], direct, atol=1e-5)
    with pytest.raises(ValueError, match="the prompt is empty"):
        encode_prompt(base, "  ")
    emb = tmp_path / "prompt.safetensors"
    save_file({"prompt_embeds": embeds}, str(emb))
    runs = []
    for text in (["--prompt", "a red car"], ["--embeddings", str(emb)]):
        out = tmp_path / f"run_{text[0][2:]}.safetensors"
        assert main(["record", "--model", "self-forcing", "--checkpoint", str(ckpt), "--base", str(base), *text,
                     "--latent-frames", "6", "--height", "32", "--width", "64", "--out", str(out)]) == 0
        runs.append(read_run(out))
    assert torch.equal(runs[0].method, runs[1].method) and torch.equal(runs[0].bf16, runs[1].bf16)
    assert main(["record", "--model", "self-forcing", "--checkpoint", str(ckpt), "--base", str(base), "--prompt",
                 "x", "--embeddings", str(emb), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "not both" in capsys.readouterr().err


def test_the_live_backend_generates_on_demand_and_shows_the_run(released):
    """What `python app.py --model self-forcing` runs per Generate (on CPU here, with the tiny models)."""
    from argparse import Namespace

    from app import world_handlers as wh
    from app.main import live_model

    ckpt, base, emb, _ = released
    live = SelfForcingLive(load_self_forcing(ckpt, base), "cpu", HEIGHT, WIDTH)
    runs = RunRegistry(Workbench())
    r = wh.live_generate_handler(runs, live, str(emb), 3, "quantwm", "kv", 2, 6)
    assert r["run_id"] == "live=Self-Forcing seed=3 quantwm kv 2-bit 6lf" and "generated live" in r["status"]
    assert r["layers"] == 2 and r["heads"] == 2 and r["frames"] == 21 and r["logit_layers"] == [1]
    assert "top-1 moved" in wh.scrub_handler(runs, r["run_id"], 20, ["top-1 jumps"])["status"]
    tr = wh.trace_pixel_handler(runs, r["run_id"], 20, 40, 20, 1, 0)
    assert tr["status"].startswith("Query frame 5, row 1, col 2")  # output frame 20 = latent frame 5
    for args, needle in (((None, 0, "quantwm", "kv", 2, 6), "no prompt and no prompt embeddings file"),
                         ((str(emb), 0, "quantwm", "kv", 2, 6, "a red car"), "not both"),
                         ((None, 0, "quantwm", "kv", 2, 6, "a red car"), "started without a base folder"),
                         ((str(emb), 0, "quantwm", "kv", 2, 7), "latent frames must be one of"),
                         ((str(emb), 0, "nope", "kv", 2, 6), "unknown method"),
                         ((str(emb), -1, "quantwm", "kv", 2, 6), "noise seed must be >= 0")):
        assert needle in wh.live_generate_handler(runs, live, *args)["status"]
    if not (base / "tokenizer").is_dir():
        save_tiny_umt5(base)
    live.base = base  # a prompt: the base model's UMT5 encodes it (loaded at the first prompt)
    r = wh.live_generate_handler(runs, live, None, 3, "quantwm", "kv", 2, 6, "a red car")
    assert r["run_id"] == "live=Self-Forcing seed=3 quantwm kv 2-bit 6lf" and live.text_encoder is not None
    from app.assemble import build_app

    demo = build_app(None, live=live, runs=runs)  # the page grows the live controls and their endpoint
    fns = demo.fns.values() if isinstance(demo.fns, dict) else demo.fns
    assert "generate_live" in {f.api_name for f in fns}
    a = Namespace(model="self-forcing", checkpoint=str(ckpt), base=str(base), height=HEIGHT, width=WIDTH)
    with pytest.raises(ValueError, match="CUDA GPU, and this machine has none"):
        live_model(a, cuda_available=False)
