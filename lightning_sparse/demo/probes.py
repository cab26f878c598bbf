"""Frozen-feature evaluation of a self-supervised backbone: weighted k-NN and a linear probe.

Both are plain torch functions on feature matrices (any device), deterministic, and fast on
demo-sized data (thousands of samples, hundreds of features: well under a second on the CPU).

Example:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> labels = torch.arange(60) % 3
    >>> feats = torch.nn.functional.one_hot(labels, 3).float() + 0.1 * torch.randn(60, 3, generator=g)
    >>> knn_predict(feats, labels, feats[:5], num_classes=3, k=5).tolist()
    [0, 1, 2, 0, 1]
    >>> probe = linear_probe_predict(feats, labels, feats, num_classes=3)
    >>> (probe == labels).float().mean().item()
    1.0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def knn_predict(
    train_features: Tensor,
    train_labels: Tensor,
    query_features: Tensor,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    chunk_size: int = 1024,
) -> Tensor:
    """Weighted k-NN classification on cosine similarity (the DINO evaluation rule).

    Each query takes its ``k`` most similar training samples (cosine similarity ``s``); each
    neighbour votes for its label with weight ``exp(s / temperature)``; the class with the largest
    total wins. ``k`` is capped at the number of training samples. Returns int64 labels.
    """
    if k < 1:
        raise ValueError(f"k={k!r} is invalid: use k >= 1 (e.g. k=20)")
    if len(train_features) == 0:
        raise ValueError("knn_predict needs at least one training sample")
    train = F.normalize(train_features.float(), dim=1)
    query = F.normalize(query_features.float(), dim=1)
    k = min(k, len(train))
    predictions = []
    for start in range(0, len(query), chunk_size):
        similarity = query[start : start + chunk_size] @ train.T
        top_sim, top_idx = similarity.topk(k, dim=1)
        weights = (top_sim / temperature).exp()
        votes = torch.zeros(
            len(top_sim), num_classes, device=query.device, dtype=weights.dtype
        )
        votes.scatter_add_(1, train_labels[top_idx].long(), weights)
        predictions.append(votes.argmax(dim=1))
    return (
        torch.cat(predictions)
        if predictions
        else torch.empty(0, dtype=torch.long, device=query.device)
    )


def linear_probe_predict(
    train_features: Tensor,
    train_labels: Tensor,
    query_features: Tensor,
    num_classes: int,
    steps: int = 300,
    lr: float = 0.1,
    weight_decay: float = 1e-4,
    seed: int = 0,
) -> Tensor:
    """Train a multinomial logistic regression on frozen features, return query predictions.

    Features are standardized with the training mean and standard deviation; the linear layer is
    trained full-batch with Adam for ``steps`` steps (deterministic given ``seed``). Safe to call
    under ``torch.no_grad()`` / ``torch.inference_mode()`` (e.g. in a validation hook): it
    trains on detached copies with gradients enabled.
    """
    with torch.inference_mode(False), torch.enable_grad():
        x = train_features.detach().float().clone()
        q = query_features.detach().float().clone()
        y = train_labels.detach().long().clone()
        mean, std = x.mean(dim=0), x.std(dim=0).clamp_min(1e-6)
        x, q = (x - mean) / std, (q - mean) / std
        generator = torch.Generator().manual_seed(seed)
        weight = (torch.randn(num_classes, x.shape[1], generator=generator) * 0.01).to(
            x.device
        )
        weight.requires_grad_(True)
        bias = torch.zeros(num_classes, device=x.device, requires_grad=True)
        optimizer = torch.optim.Adam([weight, bias], lr=lr, weight_decay=weight_decay)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(F.linear(x, weight, bias), y).backward()
            optimizer.step()
        with torch.no_grad():
            return F.linear(q, weight, bias).argmax(dim=1)
