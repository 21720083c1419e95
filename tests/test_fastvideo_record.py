"""`quantwm record --pipeline fastvideo:NAME --tiny`: a run file per paper model that the app opens, with the cache
map on its long-run strip; and the command's errors."""
import json

import fastvideo_checks  # noqa: F401  (the torchvision stand-in FastVideo needs here)
import pytest
import torch

from quantwm.adapters.fastvideo import NAMES, get_model
from quantwm.cli import main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from quantwm.drivers.registry import RunRegistry
    from quantwm.drivers.workbench import Workbench

    return RunRegistry(Workbench()), tmp_path_factory.mktemp("fastvideo-runs")


def _record(name: str, out) -> int:
    """`quantwm record --pipeline fastvideo:NAME --tiny` with neither --bits nor --budget (so at its default budget,
    2.5 bits, which fits the tiny models' head dim 32 where fixed 2-bit groups of 64 do not), logits of layer 1
    head 0, into `out`."""
    return main(["record", "--pipeline", f"fastvideo:{name}", "--tiny", "--logit-layers", "1",
                 "--logit-heads", "0", "--out", str(out)])


@pytest.mark.parametrize("name", NAMES)
def test_record_tiny_writes_a_run_the_app_opens(name, runs, capsys):
    from app import overview_handlers as oh
    from app import world_handlers as wh

    registry, folder = runs
    out = folder / f"{name}.safetensors"
    assert _record(name, out) == 0
    assert "open it with python app.py --run" in capsys.readouterr().out
    rid = registry.open(str(out))
    view = registry.view(rid)
    meta = view.run.meta
    assert meta["source"]["pipeline"] == f"fastvideo:{name}" and meta["source"]["tiny"] is True
    assert meta["bits_per_element"] <= 2.5 + 1e-6 and meta["cache_map"]
    shown = wh.open_run_handler(registry, rid, files=False)
    assert "latent preview" in shown["status"] and shown["summary"]["shift_rate"] is not None
    probed = sorted(view.run.top1)
    t = view.run.facts.first_output_frame(view.run.facts.chunk_start + probed[-1] * view.run.facts.chunk_frames)
    trace = wh.trace_pixel_handler(registry, rid, t, 4, 4, 1, 0)
    assert trace["status"].startswith("Query frame") and trace["figure"] is not None, trace["status"]
    ov = oh.overview_handler(registry, rid, t)
    assert "Cache: chunk" in ov["status"] and ov["strip"].shape[1] == 1024


def _opened(runs, name):
    """(registry, run id, view) of the tiny run of `name`: the same run the test above writes, recorded here unless
    it ran first in this process."""
    registry, folder = runs
    path = folder / f"{name}.safetensors"
    if not path.exists():
        assert _record(name, path) == 0
    rid = registry.open(str(path))
    return registry, rid, registry.view(rid)


@pytest.mark.parametrize("name, mark", [("hy-world-1.5", "memory"), ("longcat-video", "conditioning")])
def test_memory_and_conditioning_frames_are_shown_as_such(name, mark, runs):
    from app import overview_handlers as oh

    registry, rid, view = _opened(runs, name)
    entries = [e for e in view.run.meta["cache_map"] if e["read"].get(mark)]
    assert entries, view.run.meta["cache_map"]
    frame = view.run.facts.first_output_frame(entries[-1]["frames"][0])
    ov = oh.overview_handler(registry, rid, frame)
    assert f"{mark} frames" in ov["status"], ov["status"]
    band = ov["strip"][-14:]  # the cache band: a coloured mark on top of each such frame
    colour = {"memory": (44, 160, 44), "conditioning": (148, 103, 189)}[mark]
    assert (band[:4] == colour).all(-1).any()


def test_unknown_model_wrong_checkpoint_and_missing_flags_are_named(tmp_path, capsys):
    err = tmp_path / "x.safetensors"
    assert main(["record", "--pipeline", "fastvideo:sora", "--tiny", "--out", str(err)]) == 2
    assert "unknown FastVideo model 'sora'; known: lingbot-world-v2" in capsys.readouterr().err
    assert main(["record", "--pipeline", "diffusers:wan", "--tiny", "--out", str(err)]) == 2
    assert "--pipeline must be fastvideo:NAME" in capsys.readouterr().err
    assert main(["record", "--pipeline", "fastvideo:lingbot-world-v2", "--out", str(err)]) == 2
    assert "give --tiny" in capsys.readouterr().err
    folder = tmp_path / "other" / "transformer"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    assert main(["record", "--pipeline", "fastvideo:lingbot-world-v2", "--weights", str(folder.parent),
                 "--height", "64", "--width", "64", "--out", str(err)]) == 2
    assert "holds a 'WanTransformer3DModel' checkpoint, not 'LingBotWorld2CausalFastTransformer3DModel'" in \
        capsys.readouterr().err
    assert main(["record", "--tiny", "--out", str(err)]) == 2
    assert "--tiny builds a tiny FastVideo model" in capsys.readouterr().err
    assert not err.exists()


def test_weights_folder_with_corrupt_safetensors_is_named(tmp_path):
    spec = get_model("lingbot-world-v2")
    model = spec.build_tiny(0)
    folder = spec.save(model, tmp_path / "transformer")
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="does not load into FastVideo's LingBotWorld2CausalFastTransformer3DModel"):
        spec.load(tmp_path)


def test_a_missing_fastvideo_is_said_with_the_install_command(monkeypatch):
    import builtins
    import importlib

    from quantwm.adapters.fastvideo import runtime

    real = importlib.import_module

    def no_fastvideo(name, *a, **k):
        if name == "fastvideo":
            raise ModuleNotFoundError("No module named 'fastvideo'", name="fastvideo")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", no_fastvideo)
    with pytest.raises(ValueError, match=r"FastVideo is not installed: pip install 'quantwm\[fastvideo\]'"):
        runtime.require()
    assert builtins  # the import hook above is importlib's, the one runtime uses


def test_latent_preview_is_one_projection_for_both_runs():
    from quantwm.adapters.fastvideo.record import latent_preview

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(16, 3, 4, 4, generator=g)
    a, b = latent_preview(ref, ref.clone(), 8)
    assert a.shape == (3, 32, 32, 3) and a.dtype == torch.uint8 and torch.equal(a, b)
    _, c = latent_preview(ref, ref + 0.5 * torch.randn(ref.shape, generator=g), 8)
    assert not torch.equal(a, c)


def test_given_inputs_replace_the_drawn_ones_by_name(runs, tmp_path):
    """--inputs FILE: a tensor of the model's own input name is used in place of the seed's draw (the same tensor
    gives the same run, another one another run); an unknown name or shape is refused naming the model's inputs."""
    from dataclasses import replace

    from safetensors.torch import save_file

    from quantwm.adapters.fastvideo.record import record_fastvideo

    spec = get_model("lingbot-world-v2")
    model = spec.build_tiny(0)
    plan = spec.tiny_plan(4, 3)
    drawn = spec._inputs(model, plan, "cpu")["context"]
    same = spec.rollout(model, replace(plan, given=(("context", drawn.clone()),)), None).latents
    assert torch.equal(same, spec.rollout(model, plan, None).latents)
    other = spec.rollout(model, replace(plan, given=(("context", drawn + 1),)), None).latents
    assert not torch.equal(same, other)
    path = tmp_path / "inputs.safetensors"
    save_file({"prompt": torch.zeros(3)}, str(path))
    with pytest.raises(ValueError, match="takes no input 'prompt'; its inputs: cam, context, noise, y"):
        record_fastvideo("lingbot-world-v2", tiny=True, latent_frames=4, inputs=str(path))
    with pytest.raises(ValueError, match=r"input 'context' must have shape \(8, 32\) for this run, got \(2, 32\)"):
        record_fastvideo("lingbot-world-v2", tiny=True, latent_frames=4, inputs={"context": torch.zeros(2, 32)})
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        record_fastvideo("lingbot-world-v2", tiny=True, latent_frames=4,
                         inputs={"context": torch.full((8, 32), float("nan"))})
    (tmp_path / "bad.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a safetensors file"):
        record_fastvideo("lingbot-world-v2", tiny=True, latent_frames=4, inputs=str(tmp_path / "bad.safetensors"))
