"""30-second example: a tiny timm ViT on scikit-learn's handwritten digits, 2:4-sparse MLPs for the
first 70% of the optimizer steps, then dense, on the CPU.

    python examples/quickstart.py
"""

import lightning as L
import timm
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sparse import SparsityCallback


class DigitsViT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = timm.models.vision_transformer.VisionTransformer(
            img_size=8,
            patch_size=2,
            in_chans=1,
            embed_dim=64,
            depth=3,
            num_heads=4,
            num_classes=10,
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log(
            "val_acc", (self.model(x).argmax(-1) == y).float().mean(), prog_bar=True
        )

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=2e-3, weight_decay=0.05)


def main() -> None:
    L.seed_everything(0)
    digits = load_digits()  # 1797 real 8x8 images that ship with scikit-learn
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    train, val = TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])
    sparsity = SparsityCallback(
        phases=[{"sparsity": "2:4", "until": 0.7}, {"sparsity": 0.0}],
        params=["blocks.*.mlp.fc1.weight", "blocks.*.mlp.fc2.weight"],
    )
    trainer = L.Trainer(
        max_epochs=8, callbacks=[sparsity], accelerator="cpu", logger=False
    )
    trainer.fit(
        DigitsViT(),
        DataLoader(train, batch_size=64, shuffle=True),
        DataLoader(val, batch_size=256),
    )
    print(f"validation accuracy: {trainer.callback_metrics['val_acc']:.3f}")


if __name__ == "__main__":
    main()
