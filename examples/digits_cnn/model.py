"""A small CNN trained on scikit-learn's handwritten digits, tuned for accuracy.

    autoprec tune examples/digits_cnn/model.py --budget 1%

The 8x8 digit images are upsampled to 32x32 so the convolutions do real work. The model is
trained on first use (about half a minute on 2 cores, seeded) and cached beside this file.
Batches are dicts ``{"images", "labels"}``; the model takes ``labels=`` and ignores it, as
Hugging Face models do, so ``evaluate`` can score accuracy on exactly the batches it gets.
"""

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

HIGHER_IS_BETTER = True
BATCH_SIZE = 192
SEED = 0
WEIGHTS = Path(__file__).with_name("cnn-weights.pt")


class DigitsCNN(nn.Module):
    def __init__(self, width: int = 48):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * width, 4 * width, 3, padding=1)
        self.fc1 = nn.Linear(4 * width * 4 * 4, 256)
        self.classifier = nn.Linear(256, 10)

    def forward(self, images, labels=None):  # labels are accepted and ignored (HF style)
        x = F.interpolate(images, size=32, mode="bilinear", align_corners=False)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 16x16
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 8x8
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)  # 4x4
        x = F.relu(self.fc1(x.flatten(1)))
        return self.classifier(x)


def _data():
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SEED))
    return images[order], labels[order]


def _train(model, images, labels, epochs=4):
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(SEED)
    for _ in range(epochs):
        for idx in torch.randperm(len(labels), generator=g).split(64):
            loss = F.cross_entropy(model(images[idx]), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()


def get_model():
    torch.manual_seed(SEED)
    model = DigitsCNN()
    if WEIGHTS.exists():
        model.load_state_dict(torch.load(WEIGHTS, weights_only=True))
    else:
        images, labels = _data()
        _train(model, images[:1000], labels[:1000])  # the rest (797 images) is never trained on
        torch.save(model.state_dict(), WEIGHTS)
    return model.eval()


def get_batches():
    """768 of the 797 images the model never saw, in 4 batches: autoprec searches on 3, holds 1 out."""
    images, labels = _data()
    images, labels = images[1000:], labels[1000:]
    return [{"images": images[i:i + BATCH_SIZE], "labels": labels[i:i + BATCH_SIZE]}
            for i in range(0, len(labels) - BATCH_SIZE + 1, BATCH_SIZE)]


def evaluate(model, batches):
    """Accuracy in percent."""
    correct = total = 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch["images"])
            correct += int((logits.argmax(-1) == batch["labels"]).sum())
            total += len(batch["labels"])
    return 100.0 * correct / total
