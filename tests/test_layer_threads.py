"""Mask updates over several CPU threads: the same masks, weights and optimizer state as on one
thread, bit for bit; only algorithms that allow it use threads; errors reach the caller."""

import threading
import time
from typing import ClassVar

import pytest
import torch
from torch import nn

from lightning_sparse import register_algorithm
from lightning_sparse.algorithms import RigL
from lightning_sparse.core.schedule import Phase, resolve_phases
from lightning_sparse.core.selection import select_parameters
from lightning_sparse.engine.layer_threads import for_each_layer, update_threads
from lightning_sparse.engine.sparsifier import Sparsifier
from lightning_sparse.masks import elementwise as array_ops
from lightning_sparse.masks.elementwise import scratch_mask


@pytest.fixture
def torch_threads():
    """Set torch's thread count for one test, restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def net_with_layers():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(50, 16),  # 2:4: 50 rows, not a multiple of 4: groups along rows
        nn.Linear(16, 64, bias=False),  # 2:4: transposable tiles
        nn.Linear(64, 32, bias=False),
        nn.Linear(32, 8, bias=False),
    )


def train(phase: Phase, threads: int, torch_threads, steps: int = 4):
    """A few updates at ``threads`` torch threads: the final masks, weights and Adam state."""
    torch_threads(threads)
    net = net_with_layers()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    targets = select_parameters(net, params=["weight"]).targets
    sp = Sparsifier("g", targets, resolve_phases([phase], 20))
    sp.on_step_start(0, [opt])
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        sp.before_optimizer_step(step, opt, [opt])
        opt.step()
    state = [v for p in net.parameters() for v in opt.state[p].values()]
    return list(sp.masks.values()), [p.detach() for p in net.parameters()], state


@pytest.mark.parametrize(
    ("algorithm", "sparsity"),
    [("rigl", 0.8), ("set", 0.8), ("rigl", "2:4"), ("set", "2:4"), ("gmp", 0.8)],
)
def test_threads_change_nothing(algorithm, sparsity, torch_threads):
    options = {"update_every": 1, "update_stop": 10}
    if algorithm != "gmp":
        options |= {"drop_fraction": 0.5, "drop_fraction_decay": "constant"}
    phase = Phase(sparsity=sparsity, algorithm=algorithm, **options)
    one = train(phase, 1, torch_threads)
    three = train(phase, 3, torch_threads)
    for a, b in zip(one, three):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class GrowWhereThreadsSay(RigL):
    """Records the thread each layer's regrowth score is computed on."""

    threads: ClassVar[set[str]] = set()

    def grow_score(self, weight, mask, ctx):
        self.threads.add(threading.current_thread().name)
        return super().grow_score(weight, mask, ctx)


@register_algorithm("test_threads_sequential")
class Sequential(GrowWhereThreadsSay):
    threads: ClassVar[set[str]] = set()


@register_algorithm("test_threads_parallel")
class Parallel(GrowWhereThreadsSay):
    threads: ClassVar[set[str]] = set()
    layers_in_parallel = True


def test_only_algorithms_that_allow_it_run_layers_on_threads(torch_threads):
    assert RigL.layers_in_parallel and not Sequential.layers_in_parallel
    for name in ("test_threads_sequential", "test_threads_parallel"):
        phase = Phase(sparsity=0.8, algorithm=name, update_every=1, update_stop=10)
        train(phase, 2, torch_threads, steps=2)
    assert Sequential.threads == {threading.current_thread().name}
    assert Parallel.threads and all(
        name.startswith("lightning_sparse") for name in Parallel.threads
    )


def test_update_threads_follow_torch_and_stay_on_one_thread_where_needed(
    torch_threads,
):
    torch_threads(4)
    cpu = [torch.zeros(2) for _ in range(3)]
    assert update_threads(True, cpu) == 3  # at most one per layer
    assert update_threads(True, cpu + cpu) == 4
    assert update_threads(False, cpu) == 1
    assert update_threads(True, [*cpu, torch.zeros(2, device="meta")]) == 1
    assert update_threads(True, [nn.Parameter(torch.zeros(2)) for _ in range(2)]) == 2
    torch_threads(1)
    assert update_threads(True, cpu) == 1


def test_the_first_error_reaches_the_caller_after_every_layer_ran():
    done = []

    def work(name):
        if name == "bad":
            raise ValueError("layer bad failed")
        done.append(name)

    names = ["a", "bad", "b", "c"]
    with pytest.raises(ValueError, match="layer bad failed"):
        for_each_layer(work, names, sizes=[1, 4, 2, 3], workers=2)
    assert sorted(done) == ["a", "b", "c"]


def test_a_new_thread_count_releases_the_old_threads_buffers():
    def work(size):
        scratch_mask(size, torch.device("cpu"), slot=5)
        time.sleep(0.05)  # every worker gets a layer

    for workers in (3, 2):
        for_each_layer(work, [10, 20, 30, 40], sizes=[1, 2, 3, 4], workers=workers)
    holders = {thread for (_, slot, thread) in array_ops._SCRATCH if slot == 5}
    assert len(holders) == 2  # the 2 threads of the current pool, none of the 3 before
