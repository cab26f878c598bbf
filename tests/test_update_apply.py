"""A mask update takes effect bit for bit as the plain rule says: the weight multiplied by the new
mask (signed zeros), optimizer state zeroed exactly where the mask changed, gradients multiplied
by the new mask; whether the update edits few entries (by index) or many (whole tensors)."""

import pytest
import torch
from torch import nn

from lightning_sparse.schedule import Phase, resolve_phases
from lightning_sparse.selection import select_parameters
from lightning_sparse.sparsifier import Sparsifier


def bits(tensor):
    return tensor.detach().contiguous().view(torch.int32)


@pytest.mark.parametrize(
    ("algorithm", "drop_fraction"),
    [("rigl", 0.004), ("rigl", 0.3), ("set", 0.004), ("set", 0.3), ("gmp", None)],
)
def test_update_applies_exactly_the_new_mask(algorithm, drop_fraction):
    torch.manual_seed(0)
    net = nn.Linear(256, 256, bias=False)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
    options = {"update_every": 1, "update_stop": 50}
    if drop_fraction is not None:
        options |= {"drop_fraction": drop_fraction, "drop_fraction_decay": "constant"}
    phase = Phase(sparsity=0.5, algorithm=algorithm, **options)
    sp = Sparsifier(
        "g",
        select_parameters(net, params=["weight"]).targets,
        resolve_phases([phase], 100),
    )
    sp.on_step_start(0, [opt])
    for step in range(4):
        net.weight.grad = torch.randn(256, 256)
        grad = net.weight.grad.clone()
        weight = net.weight.detach().clone()
        state = {k: v.clone() for k, v in opt.state[net.weight].items()}
        mask = sp.masks["weight"].clone()
        sp.before_optimizer_step(step, opt, [opt])
        new = sp.masks["weight"]
        changed = mask ^ new
        if step:  # an update step: some entries changed
            assert changed.any()
        assert torch.equal(bits(net.weight), bits(weight * new))
        assert torch.equal(bits(net.weight.grad), bits(grad * new))
        for key, value in opt.state[net.weight].items():
            if value.shape == weight.shape:
                expected = state[key].masked_fill(changed, 0)
                assert torch.equal(bits(value), bits(expected)), key
        opt.step()
