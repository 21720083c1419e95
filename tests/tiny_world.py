"""A tiny built-in world model (2 layers, 1 head, 4x4-patch frames) with every weight drawn, for fast tests."""
import torch

from quantwm.world.model import WorldConfig, WorldModel

TINY = WorldConfig(dim=64, heads=1, layers=2, view=4, world_patches=12, context_frames=2, chunk_frames=2)


def tiny_world_model() -> WorldModel:
    torch.manual_seed(0)
    m = WorldModel(TINY).eval()
    for p in m.parameters():  # adaLN starts at zero; give every weight a value so the test means something
        torch.nn.init.normal_(p, std=0.05)
    return m
