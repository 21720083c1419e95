import os

# The processes tests start (the CLI, the benchmarks, the app's server) run torch on one thread, as the tests do
# (`_single_thread`): at these sizes a second thread only spins against the suite's other worker. Set before torch
# loads numpy: OpenBLAS (the Triton interpreter's tl.dot) reads it once, and its threads spin while they wait.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the kernels run under the Triton interpreter; this must be set before anything imports
# kernels/. With one, the same kernel tests run compiled on CUDA (tests/test_kernels.py moves their tensors).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Small tensors: one intra-op thread is as fast and does not spin against other work on the machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def small_trace_path(tmp_path_factory):
    """A small synthetic world trace file: 2 layers, 2 heads x 64, 8x8-token frames, 12 cached frames."""
    from quantwm.evaluation.synthetic import make_synthetic_trace

    path = tmp_path_factory.mktemp("trace") / "syn.safetensors"
    make_synthetic_trace(seed=3, n_layers=2, n_heads=2, head_dim=64, grid=(8, 8), cached_frames=12,
                         chunk_frames=2, world=(20, 28)).save(path)
    return path


@pytest.fixture(scope="session")
def tiny_trace_path(tmp_path_factory) -> str:
    """A one-layer synthetic trace of the `aligned` kind (tuning seed 100003): 2 heads x 32, 8x8-token frames, 6 cached
    frames in chunks of 2: the benchmarks' trace probes at test size."""
    from quantwm.evaluation.synthetic import make_synthetic_trace

    path = tmp_path_factory.mktemp("tiny") / "t.pt"
    make_synthetic_trace(seed=100003, n_layers=1, n_heads=2, head_dim=32, grid=(8, 8), cached_frames=6,
                         chunk_frames=2, content_dim=8, kind="aligned").save(path)
    return str(path)


@pytest.fixture
def app_start(monkeypatch, capsys, tmp_path):
    """Start the app's `main` (what `python -m quantwm.app` runs) in this process, for a start that must end:
    (exit code, stderr). The environment it sets is put back afterwards."""
    def start(argv: list[str]) -> tuple[int, str]:
        import app.assemble
        from app.main import main

        def past_checks(*_, **__):
            raise AssertionError("the app got past its start-up checks")

        monkeypatch.setattr(app.assemble, "build_app", past_checks)  # never a server that blocks the test
        monkeypatch.setenv("GRADIO_SERVER_PORT", os.environ.get("GRADIO_SERVER_PORT", ""))  # main sets it
        monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
        with pytest.raises(SystemExit) as ended:
            main(argv, restart=False)
        return ended.value.code, capsys.readouterr().err
    return start


@pytest.fixture(scope="module")
def wb():
    """A Workbench on the built-in world model, one per test module (modules that need another define their own)."""
    from quantwm.drivers.workbench import Workbench

    return Workbench()


@pytest.fixture(scope="module")
def runs(wb):
    """The run registry over the module's `wb`."""
    from quantwm.drivers.registry import RunRegistry

    return RunRegistry(wb)


# (fingerprint of the world model's weights, RunKey) -> (the Record as its rollout returned it, its progress calls)
_ROLLOUTS: dict = {}
_FINGERPRINTS: dict = {}  # id(model) -> (model, fingerprint)


def _fingerprint(model) -> tuple:
    """The weights' identity: their count, sum and sum of squares (a model loaded from other weights differs)."""
    held = _FINGERPRINTS.get(id(model))
    if held is None or held[0] is not model:
        with torch.no_grad():
            flat = torch.cat([p.detach().flatten().double() for p in model.parameters()])
        held = _FINGERPRINTS[id(model)] = (model, (flat.numel(), float(flat.sum()), float(flat.square().sum())))
    return held[1]


@pytest.fixture(scope="module")
def shared_rollouts():
    """Rollouts of the built-in world model made once per test process for the modules that ask for it (those that
    test what the app, its handlers and its files show of a run, not how a run is made; test_workbench.py and
    test_reliability.py make their own): a Workbench asked for a run some module already made gets a copy of that
    Record (its metrics and flow still to compute, as a new rollout's) and its progress calls replayed, instead
    of the same seconds of generation again. A rollout is a pure function of the weights and the RunKey."""
    import dataclasses

    from quantwm.drivers.workbench import Workbench

    real = Workbench._rollout

    def rollout(self, key, progress):
        slot = (_fingerprint(self.model), key)
        made = _ROLLOUTS.get(slot)
        if made is None:
            calls = []

            def tee(done, total):
                calls.append((done, total))
                if progress is not None:
                    progress(done, total)

            made = _ROLLOUTS[slot] = (real(self, key, tee), calls)
        elif progress is not None:
            for done, total in made[1]:
                progress(done, total)
        return dataclasses.replace(made[0], metrics={}, flow=None)

    patch = pytest.MonkeyPatch()
    patch.setattr(Workbench, "_rollout", rollout)
    yield
    patch.undo()
