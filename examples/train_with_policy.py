"""Train a small CNN on scikit-learn's handwritten digits under a mixed-precision policy, next to fp32.

    python examples/train_with_policy.py                        # the hand-written policy below
    python examples/train_with_policy.py --policy policy.json   # e.g. the one `autoprec tune` wrote

The model is the one ``autoprec tune examples/digits_cnn/model.py`` tunes, so a policy it writes
applies here as is. The training loop is an ordinary one: the policy adds one line,
``apply_policy(model, policy, mode="training")``, and ``TrainStep`` does backward and the optimizer
step, with loss scaling only when the policy has an fp16 layer. The weights stay fp32 throughout.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from digits_cnn.model import DigitsCNN
from sklearn.datasets import load_digits

from autoprec import Policy, apply_policy
from autoprec.runtime.training import TrainStep

# The convolutions and fc1 in bf16 (fast on CPUs with AMX-BF16 and on recent GPUs); the classifier
# an fp32 island, so the logits and the loss keep full precision.
HAND_WRITTEN = Policy(default="bf16", layers={"classifier": "fp32"})

EPOCHS = 5
BATCH_SIZE = 64
LR = 2e-3
WIDTH = 16  # channels of the first convolution; digits_cnn/model.py uses 48 for its tuned model
SEED = 0


def load_data(n_train: int = 1200, seed: int = SEED):
    """The 1797 digit images (1x8x8, scaled to [0, 1]) shuffled once and split into train and test."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, test = order[:n_train], order[n_train:]
    return images[train], labels[train], images[test], labels[test]


def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(images).argmax(-1) == labels).sum().item()
    model.train()
    return 100.0 * correct / len(labels)


def train(policy: Policy | None, data, epochs: int = EPOCHS, width: int = WIDTH, seed: int = SEED):
    """Train from scratch, yielding (mean train loss, test accuracy %) after each epoch."""
    train_x, train_y, test_x, test_y = data
    torch.manual_seed(seed)
    model = DigitsCNN(width)
    if policy is not None:
        apply_policy(model, policy, mode="training")  # the one change to the loop
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    step = TrainStep(policy or Policy(), optimizer)  # backward, step, zero_grad (+ loss scaling for fp16)

    shuffle = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        total = 0.0
        for idx in torch.randperm(len(train_y), generator=shuffle).split(BATCH_SIZE):
            loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
            step(loss)
            total += loss.item() * len(idx)
        yield total / len(train_y), accuracy(model, test_x, test_y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", help="a policy.json to train under (default: the hand-written one)")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args()
    policy = Policy.load(args.policy) if args.policy else HAND_WRITTEN
    print(f"policy: {args.policy or 'hand-written'}\n{policy}\n")

    # The two runs train in lockstep, an epoch each in turn. Only loss and accuracy are compared
    # here; for speed, measure (benchmarks/, `autoprec tune`): one unwarmed timing says little.
    data = load_data()
    fp32_run, policy_run = train(None, data, args.epochs), train(policy, data, args.epochs)
    print(f"epoch  {'fp32 loss':>9}  {'acc %':>6}  {'policy loss':>11}  {'acc %':>6}")
    for epoch, ((loss32, acc32), (loss, acc)) in enumerate(zip(fp32_run, policy_run, strict=True), 1):
        print(f"{epoch:5d}  {loss32:9.4f}  {acc32:6.2f}  {loss:11.4f}  {acc:6.2f}", flush=True)


if __name__ == "__main__":
    main()
