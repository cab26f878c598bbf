"""A tiny timm ViT on scikit-learn's handwritten digits, 2:4-sparse MLPs for the first 70% of
the optimizer steps, then dense, on the CPU, written as plain Lightning code.

The same as ``lightning-sparse fit --config recipes/vit/cpu_demo.yaml`` with a shorter run
(10 epochs instead of 30). Like that command, it first lets OpenMP threads sleep instead of
spinning when other processes keep the machine busy (same results; see docs/cli.md, "Shared
machines and CI"): that has to happen before torch is imported. Its run time on a busy
machine, with and without that choice, is in docs/benchmarks.md ("The quickstart on a shared
machine").

    python examples/quickstart.py
"""

from lightning_sparse.openmp import choose_wait_policy

choose_wait_policy("quickstart")  # before torch loads: libgomp reads the policy then

import lightning as L  # after the wait policy

from lightning_sparse import SparsityCallback
from lightning_sparse.demo import DigitsDataModule, ViTClassifier


def main() -> None:
    L.seed_everything(0)
    sparsity = SparsityCallback(
        phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}],
        params=["blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc2.weight"],
    )
    trainer = L.Trainer(
        max_epochs=10,
        callbacks=[sparsity],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(ViTClassifier(num_classes=10), DigitsDataModule())
    print(f"validation accuracy: {trainer.callback_metrics['val/acc']:.3f}")


if __name__ == "__main__":
    main()
