"""The ``lightning-sparse`` command's entry module: ``--help`` and ``--version`` without torch or
Lightning, the subcommands through LightningCLI, and the OpenMP wait policy it chooses on a busy
machine (same results, bit for bit)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_sparse
from lightning_sparse import openmp
from lightning_sparse.cli import entry

ROOT = Path(__file__).resolve().parents[1]
VIT_DEMO = ROOT / "recipes" / "vit" / "cpu_demo.yaml"
HEAVY = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "jsonargparse")


def python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter with this checkout first on the path."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=environ,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_and_version_import_neither_torch_nor_lightning():
    out = python(
        "import sys\n"
        "from lightning_sparse.cli.entry import main\n"
        "main(['--help']); main(['--version']); main([])\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    assert out.startswith(
        "usage: lightning-sparse [-h] [--version] {fit,validate,plan}"
    )
    assert "Sparse training on a schedule for PyTorch Lightning" in out
    assert f"lightning-sparse {lightning_sparse.__version__}\n" in out
    assert out.rstrip().endswith("[]")


def test_the_package_imports_its_public_names_on_first_use():
    out = python(
        "import sys, lightning_sparse\n"
        "print('torch' in sys.modules)\n"
        "print(lightning_sparse.SparsityCallback.__module__)\n"
        "print(set(lightning_sparse.__all__) <= set(dir(lightning_sparse)))\n"
    )
    assert out.split() == ["False", "lightning_sparse.callback", "True"]
    assert all(getattr(lightning_sparse, name) for name in lightning_sparse.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'SparseCallback'"):
        lightning_sparse.SparseCallback  # noqa: B018


def test_subcommands_run_through_the_cli(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # nothing to choose
    entry.main(["plan", f"--config={VIT_DEMO}", "--plot=false"])
    captured = capsys.readouterr()
    assert "Run: 1350 optimizer steps" in captured.out and captured.err == ""
    with pytest.raises(SystemExit) as exit_info:
        entry.main(["plan", "--help"])
    assert exit_info.value.code == 0 and "--gpu" in capsys.readouterr().out


def test_a_busy_machine_gets_sleeping_openmp_threads_and_is_told(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-sparse"])
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # restored after the test
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(openmp, "load_and_cores", lambda: (3.2, 2))
    entry.main(["plan", f"--config={VIT_DEMO}", "--plot=false"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    err = capsys.readouterr().err
    assert err.startswith("lightning-sparse: the load average (3.2 on 2 cores) says")
    assert "set OMP_WAIT_POLICY=ACTIVE to keep them spinning" in err


@pytest.mark.parametrize(
    "chosen",
    [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}],
    ids=["OMP_WAIT_POLICY", "GOMP_SPINCOUNT"],
)
def test_a_wait_policy_the_environment_chose_is_left_alone(capsys, monkeypatch, chosen):
    """On a busy machine too: libgomp's GOMP_SPINCOUNT says how long threads spin, so it
    chooses a policy as much as OMP_WAIT_POLICY does."""
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    for name, value in chosen.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(openmp, "load_and_cores", lambda: (3.2, 2))
    openmp.choose_wait_policy()
    policies = {
        name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    assert policies == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, **chosen}
    assert capsys.readouterr().err == ""


TRAIN = """
import hashlib, os, sys
from lightning_sparse import openmp
openmp.load_and_cores = lambda: ({load}, 2)
openmp.choose_wait_policy()  # as the command does, before torch loads
loaded = "torch" in sys.modules
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
for _ in range(20):
    loss = net(torch.randn(128, 256)).square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
print(os.environ.get("OMP_WAIT_POLICY"), loaded, torch.get_num_threads(), hashlib.sha256(
    b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest())
"""


def test_the_wait_policy_leaves_results_bit_for_bit(monkeypatch):
    """On a busy machine the command makes OpenMP threads sleep, set before torch loads; the
    thread count stays, and so does every bit of the training that follows, as on an idle
    machine, where OpenMP's default stays: the policy only says how idle threads wait."""
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    busy = python(TRAIN.format(load=3.2), OMP_NUM_THREADS="2").split()
    idle = python(TRAIN.format(load=0.0), OMP_NUM_THREADS="2").split()
    assert busy[:3] == ["PASSIVE", "False", "2"] and idle[:3] == ["None", "False", "2"]
    assert busy[3] == idle[3]
