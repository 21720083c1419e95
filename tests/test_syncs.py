"""quantwm/core/syncs.py: HostSyncs sees every kind of call that makes the host wait on a device, and nothing else."""
import torch

from quantwm.core.syncs import HostSyncs


def test_host_syncs_sees_reads_value_shaped_results_and_host_copies():
    x = torch.arange(6.0)
    with HostSyncs() as h:
        bool(x.any()), x[0].item(), x.tolist(), int(x[1]), float(x[2]), f"{x[3]:.1f}", x.cpu(), x.to("cpu")
        torch.equal(x, x), x.nonzero(), x.unique(), x[x > 2], torch.where(x > 2)
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1])), torch.tensor([1.0])
    assert h.calls == ["__bool__", "item", "tolist", "__int__", "__float__", "__format__", "cpu", "to", "equal",
                       "nonzero", "unique", "__getitem__", "where", "tensor", "repeat_interleave", "tensor"]


def test_host_syncs_lets_device_side_work_pass():
    x = torch.randn(4, 8)
    with HostSyncs() as h:
        y = (x @ x.T).softmax(-1)
        torch.where(y > 0.5, y, 0.0), y[:, :2], y[torch.tensor([0, 2])], y.repeat_interleave(2, dim=0), x.to(y.dtype)
    assert h.calls == ["tensor"]  # the index tensor built from a host list; indexing by it waits on nothing
