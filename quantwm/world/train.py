"""Train the built-in world model: `python -m quantwm.world.train --steps N --out assets/world_model.safetensors`.

Flow matching (rectified flow): for every generated chunk a flow time t ~ logit-normal, x_t = t x + (1-t) ε,
target velocity x - ε; the clean frames run beside the noisy ones under the block mask of
`training_mask`, so the noisy chunk sees exactly the clean history that generation will cache. Worlds are
drawn from training seeds >= TRAIN_SEED_BASE only (evaluation uses seeds below it). A checkpoint (model,
optimizer, step, RNG) is written every `--ckpt-every` steps and the run resumes from it, so long training
can run in the background and be continued.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from .model import WorldConfig, WorldModel, training_mask
from .scene import TRAIN_SEED_BASE, TRAJECTORIES, WORLDS, make_world, patchify, render, token_world_coords, trajectory


def sample_clip(rng: torch.Generator, cfg: WorldConfig, n_frames: int, n_worlds: int, worlds: dict,
                world: str = "photo"):
    """One training clip: tokens (T*N, P) in [-1, 1] and coords (T*N, 3)."""
    seed = TRAIN_SEED_BASE + int(torch.randint(0, n_worlds, (1,), generator=rng))
    if seed not in worlds:
        worlds[seed] = make_world(seed, cfg.world_patches * cfg.patch, world)
    kind = TRAJECTORIES[int(torch.randint(0, len(TRAJECTORIES), (1,), generator=rng))]
    poses = trajectory(kind, n_frames, int(torch.randint(0, 2 ** 30, (1,), generator=rng)), cfg.world_patches, cfg.view)
    frames = render(worlds[seed], poses, cfg.view, cfg.patch)
    tokens = patchify(frames, cfg.patch).reshape(-1, cfg.patch_dim) * 2 - 1
    t0 = int(torch.randint(0, 24, (1,), generator=rng))  # random time offset: positions of longer rollouts
    wc = token_world_coords(poses, cfg.view)
    tt = (torch.arange(n_frames) + t0)[:, None, None].expand(n_frames, cfg.tokens_per_frame, 1)
    return tokens, torch.cat([tt, wc], -1).reshape(-1, 3)


def flow_batch(rng: torch.Generator, cfg: WorldConfig, batch: int, n_frames: int, n_worlds: int, worlds: dict,
               world: str = "photo"):
    """Inputs, flow times, coords and velocity targets for one step."""
    clips = [sample_clip(rng, cfg, n_frames, n_worlds, worlds, world) for _ in range(batch)]
    clean = torch.stack([c[0] for c in clips])  # (B, T*N, P)
    n = cfg.tokens_per_frame
    gen = clean[:, cfg.context_frames * n:]
    n_chunks = (n_frames - cfg.context_frames) // cfg.chunk_frames
    t_chunk = torch.sigmoid(torch.randn(batch, n_chunks, generator=rng))  # logit-normal flow time
    t = t_chunk.repeat_interleave(cfg.chunk_frames * n, dim=1)
    eps = torch.randn(gen.shape, generator=rng)
    noisy = t[..., None] * gen + (1 - t[..., None]) * eps
    tokens = torch.cat([clean, noisy], 1)
    times = torch.cat([torch.ones(batch, clean.shape[1]), t], 1)
    n_ctx = cfg.context_frames * n
    coords = torch.stack([torch.cat([c[1], c[1][n_ctx:]]) for c in clips])  # (B, L, 3): noisy = clean coords
    return tokens, times, coords, gen - eps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="train the built-in world model")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--frames", type=int, default=12, help="frames per training clip (context included)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--worlds", type=int, default=4000, help="number of distinct training worlds")
    ap.add_argument("--world", choices=WORLDS, default="photo", help="world kind (photo: training photographs only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt", default="out/world_ckpt.pt")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--out", default="assets/world_model.safetensors")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--init", help="start from these weights (a safetensors export), fresh optimizer and schedule")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weights", choices=WEIGHT_FORMATS, default="int8", help="export format (see export)")
    ap.add_argument("--widen", action="store_true", help="with --init: double the width (Net2Net, function-preserving)")
    ap.add_argument("--widen-noise", type=float, default=0.01, help="symmetry-breaking noise for --widen")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = WorldConfig()
    if (a.frames - cfg.context_frames) % cfg.chunk_frames or a.frames <= cfg.context_frames:
        raise SystemExit(f"--frames must exceed {cfg.context_frames} by a multiple of {cfg.chunk_frames}")
    torch.manual_seed(a.seed)
    rng = torch.Generator().manual_seed(a.seed)
    step, log, state = 0, [], None
    ckpt = Path(a.ckpt)
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        cfg = WorldConfig(**state.get("config", asdict(cfg)))
        model = WorldModel(cfg)
        model.load_state_dict(state["model"])
        step, log = state["step"], state.get("log", [])
        rng.set_state(state["rng"])
        print(f"resumed from {ckpt} at step {step}", flush=True)
    elif a.init:
        from .generate import load_world_model

        model = load_world_model(a.init).train()
        if a.widen:
            model = widen(model, noise=a.widen_noise, seed=a.seed)
        cfg = model.cfg
        print(f"initialised from {a.init}" + (f", widened to dim {cfg.dim}, {cfg.heads} heads" if a.widen else ""),
              flush=True)
    else:
        model = WorldModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.99))
    if state is not None:
        opt.load_state_dict(state["opt"])
    def info(at: int) -> dict:
        return {"steps": at, "seed": a.seed, "batch": a.batch, "frames": a.frames, "worlds": a.worlds, "lr": a.lr,
                "init": a.init, "widen": a.widen, "world": a.world}

    mask = training_mask(a.frames, cfg)
    worlds: dict = {}
    warmup = a.warmup
    t_start, losses, exported = time.time(), [], None
    while step < a.steps:
        lr = a.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        tokens, times, coords, target = flow_batch(rng, cfg, a.batch, a.frames, a.worlds, worlds, a.world)
        n_clean = a.frames * cfg.tokens_per_frame
        pred = model(tokens, times, coords, mask=mask)[:, n_clean:]
        loss = torch.nn.functional.mse_loss(pred, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        if len(worlds) > 256:
            worlds.clear()
        if step % 10 == 0:
            entry = {"step": step, "loss": sum(losses) / len(losses), "lr": lr, "s_per_step": (time.time() - t_start) / len(losses)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
            t_start, losses = time.time(), []
        if step % a.ckpt_every == 0 or step == a.steps:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                        "rng": rng.get_state(), "config": asdict(cfg)}, ckpt)
            export(model, a.out, info(step), a.weights)
            exported = step
    if exported != step:  # resumed at --steps: nothing trained, re-export the checkpoint
        export(model, a.out, info(step), a.weights)
    print(f"exported step {step} to {a.out} ({a.weights})", flush=True)


def widen(model: WorldModel, noise: float = 0.0, seed: int = 0) -> WorldModel:
    """A model twice as wide (dim x2, heads x2, head dim kept) computing the same function (Net2Net).

    Every stream channel, head and MLP unit is duplicated: LayerNorm over [x, x] equals [LN(x), LN(x)], a
    layer reading duplicated inputs takes half weights from each copy, and the time embedding's old
    frequencies are the even ones of the wider embedding. `noise` (relative to each weight's std) breaks
    the symmetry between the copies so that training can use the new width.
    """
    cfg = model.cfg
    wide = WorldModel(replace(cfg, dim=2 * cfg.dim, heads=2 * cfg.heads))
    d, g = cfg.dim, torch.Generator().manual_seed(seed)
    src = {k: v.detach().float() for k, v in model.state_dict().items()}

    def both(w):  # input duplicated, output duplicated: (o, i) -> (2o, 2i)
        return torch.cat([torch.cat([w / 2, w / 2], 1)] * 2, 0)

    def dup_chunks(w, n):  # n stacked outputs, each duplicated; input duplicated
        return torch.cat([both(c) for c in w.chunk(n, 0)], 0)

    def dup_bias(b, n=1):
        return torch.cat([torch.cat([c, c]) for c in b.chunk(n, 0)])

    new = {}
    new["patch_in.weight"], new["patch_in.bias"] = torch.cat([src["patch_in.weight"]] * 2), dup_bias(src["patch_in.bias"])
    w1 = torch.zeros(2 * d, 2 * d)
    half = d // 2  # the old embedding's cos/sin columns sit at the even columns of the wider one's halves
    w1[:d, 0:d:2], w1[:d, d::2] = src["time.0.weight"][:, :half], src["time.0.weight"][:, half:]
    w1[d:] = w1[:d]
    new["time.0.weight"], new["time.0.bias"] = w1, dup_bias(src["time.0.bias"])
    new["time.2.weight"], new["time.2.bias"] = both(src["time.2.weight"]), dup_bias(src["time.2.bias"])
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        new[p + "ada.weight"], new[p + "ada.bias"] = dup_chunks(src[p + "ada.weight"], 6), dup_bias(src[p + "ada.bias"], 6)
        new[p + "attn.qkv.weight"] = dup_chunks(src[p + "attn.qkv.weight"], 3)
        new[p + "attn.qkv.bias"] = dup_bias(src[p + "attn.qkv.bias"], 3)
        new[p + "attn.proj.weight"], new[p + "attn.proj.bias"] = both(src[p + "attn.proj.weight"]), dup_bias(src[p + "attn.proj.bias"])
        for n in ("q_norm.weight", "k_norm.weight"):
            new[p + "attn." + n] = src[p + "attn." + n]
        new[p + "attn.log_temp"] = dup_bias(src[p + "attn.log_temp"])
        for j in (0, 2):
            new[p + f"mlp.{j}.weight"] = both(src[p + f"mlp.{j}.weight"])
            new[p + f"mlp.{j}.bias"] = dup_bias(src[p + f"mlp.{j}.bias"])
    new["ada_out.weight"], new["ada_out.bias"] = dup_chunks(src["ada_out.weight"], 2), dup_bias(src["ada_out.bias"], 2)
    w = src["out.weight"]
    new["out.weight"], new["out.bias"] = torch.cat([w / 2, w / 2], 1), src["out.bias"]
    if noise:
        for k, v in new.items():
            if v.dim() == 2 and v.std() > 0:
                new[k] = v + noise * v.std() * torch.randn(v.shape, generator=g)
    wide.load_state_dict(new)
    return wide


WEIGHT_FORMATS = ("int8", "fp16")


def export(model: WorldModel, path: str, train_info: dict, weights: str = "int8") -> None:
    """Weights as safetensors with the config and training facts in the metadata.

    "int8": every matrix as int8 with one fp32 scale per output row (absmax / 127; `<name>::scale`), the
    rest fp16: half the size of fp16, which keeps the committed model under the repository's size budget.
    "fp16": every tensor fp16.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in model.state_dict().items():
        v = v.detach().float()
        if weights == "int8" and v.dim() == 2:
            scale = (v.abs().amax(1) / 127).clamp_min(1e-12)
            tensors[k] = torch.round(v / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            tensors[k + "::scale"] = scale.contiguous()
        else:
            tensors[k] = v.to(torch.float16).contiguous()
    save_file(tensors, path, metadata={"config": json.dumps(model.config_dict()), "train": json.dumps(train_info),
                                       "weights": weights})


if __name__ == "__main__":
    main()
