"""Training code written for CUDA, run on the device unmodified: a plain PyTorch loop in the style of
PyTorch's "Training a Classifier" tutorial, and Hugging Face's Trainer.

Reference: the same code on CPU. The loop takes its device as a string (the tutorial's `device =
torch.device(...)` line is the only difference). The Trainer: transformers finds the device itself
through `torch.accelerator`, as it finds CUDA, and accelerate, which places its batches, is given the
device string in its documented ACCELERATE_TORCH_DEVICE (TrainingArguments' `use_cpu=True` gives the
CPU run). Same seeds, same data, dropout off. Tolerance: per-step losses within 1e-4 relative
(fp32; XLA and PyTorch's CPU kernels reduce in different orders and the optimizer carries the
difference on; measured ~1e-6), and the loss must fall.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchbridge

DEV = torchbridge.device_name()
pytestmark = pytest.mark.skipif(torchbridge.registration_error() is not None,
                                reason=f"device backend unavailable: {torchbridge.registration_error()}")
RTOL = 1e-4


class Net(nn.Module):
    """The tutorial's network (two conv layers, max-pooling, three linear layers) for 3x32x32 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def _images(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Offline stand-in for CIFAR-10: noise images whose class is the brightest of 10 image regions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 32, 32, generator=g) * 0.5
    labels = torch.randint(0, 10, (n,), generator=g)
    for i, c in enumerate(labels.tolist()):
        x[i, :, (c // 5) * 16:(c // 5) * 16 + 16, (c % 5) * 6:(c % 5) * 6 + 6] += 0.5
    return torch.utils.data.TensorDataset((x - 0.5) / 0.5, labels)


def train_classifier(device_name: str, epochs: int = 2) -> tuple[list[float], float]:
    """The tutorial's loop, verbatim but for the data: SGD with momentum, CrossEntropyLoss, loss.item()."""
    device = torch.device(device_name)
    torch.manual_seed(0)
    trainloader = torch.utils.data.DataLoader(_images(256, 1), batch_size=16, shuffle=True,
                                              generator=torch.Generator().manual_seed(2))
    testloader = torch.utils.data.DataLoader(_images(128, 3), batch_size=32, shuffle=False)
    net = Net()
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _epoch in range(epochs):
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    correct = total = 0
    with torch.no_grad():
        for images, labels in testloader:
            images, labels = images.to(device), labels.to(device)
            outputs = net(images)
            _, predicted = torch.max(outputs, 1)
            total += labels.size(0)
            correct += (predicted == labels).sum().item()
    return losses, correct / total


def test_tutorial_classifier_loop_on_the_device_matches_cpu():
    cpu_losses, cpu_acc = train_classifier("cpu")
    dev_losses, dev_acc = train_classifier(DEV)
    torch.testing.assert_close(torch.tensor(dev_losses), torch.tensor(cpu_losses), rtol=RTOL, atol=1e-6)
    assert sum(cpu_losses[-8:]) < sum(cpu_losses[:8]) - 0.5  # it learns
    assert dev_acc == pytest.approx(cpu_acc, abs=1 / 128)  # at most one borderline test image differs


class _Sequences(torch.utils.data.Dataset):
    """Token sequences labelled by whether token 7 occurs more often than token 3."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 32, (n, 24), generator=g)
        self.labels = ((self.ids == 7).sum(1) > (self.ids == 3).sum(1)).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _hf_trainer_run(tmp_path, use_cpu: bool) -> tuple[list[float], str]:
    from accelerate.state import AcceleratorState
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    AcceleratorState._reset_state(reset_partial_state=True)  # the two runs share this process
    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=str(tmp_path / ("cpu" if use_cpu else "device")), use_cpu=use_cpu,
                             per_device_train_batch_size=16, max_steps=12, learning_rate=3e-3, logging_steps=1,
                             seed=0, data_seed=0, report_to=[], save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=_Sequences(192, 1))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, str(next(trainer.model.parameters()).device)


def test_hugging_face_trainer_on_the_device_matches_cpu(tmp_path, monkeypatch):
    cpu_losses, cpu_where = _hf_trainer_run(tmp_path, use_cpu=True)
    # accelerate (which feeds the Trainer its batches) knows CUDA, XPU, NPU... by name and takes any other
    # device from its documented ACCELERATE_TORCH_DEVICE: the device string, the only change
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", DEV)
    dev_losses, dev_where = _hf_trainer_run(tmp_path, use_cpu=False)
    assert cpu_where == "cpu" and dev_where.startswith(DEV)  # the Trainer chose the device by itself
    assert len(dev_losses) == len(cpu_losses) == 12
    torch.testing.assert_close(torch.tensor(dev_losses), torch.tensor(cpu_losses), rtol=RTOL, atol=1e-6)
    assert cpu_losses[-1] < cpu_losses[0]
