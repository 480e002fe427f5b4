#!/usr/bin/env python3
"""The Fashion-MNIST CNN of examples/torch_fashion_mnist as a plain Python
PyTorch training loop on one device: the reference that scripts/gpu-check.sh
holds `torch_fashion_mnist --device gpu` to (docs/benchmarks.md, "PyTorch side
by side").

Same model as examples/torch_fashion_mnist/cnn.h (input standardized with mean
0.2860 and deviation 0.3530; conv 5x5 1->16 pad 2, batch norm, ReLU, max-pool 2;
conv 5x5 16->32 pad 2, batch norm, ReLU, max-pool 2; fc 1568->128, ReLU; fc
128->10; mean cross-entropy), same defaults as the example (batch 128, SGD lr
0.05 momentum 0.9, seed 1, the last short batch of an epoch kept), and the
same loss-read cadence: the loss stays on the device and is read (and checked
for NaN) every 50 steps and at the end of each epoch. The data are held on the
host; each batch is gathered there and copied to the device, as the example's
input pipeline does. samples/s counts the training loop only (from the first
step to the last, as the example does), not loading or evaluation.

--deterministic: PyTorch's deterministic kernels (cuDNN's and cuBLAS's
included), as the example's flag of that name. Without CUDA it runs on the CPU
(to prove the script; the figures then mean nothing for the GPU bar). The last
line is parseable, in the example's format:

  final: strategy=pytorch_loop replicas=1 epochs=E test_accuracy=A samples_per_sec=S train_loss=L device=cuda|cpu

  python3 benchmarks/pytorch/fashion_mnist_loop.py --data DIR [--epochs 1] [--limit N]
      [--test-limit N] [--batch 128] [--deterministic] [--device auto|cuda|cpu]
"""
import argparse
import gzip
import math
import os
import struct
import sys
import time

import torch

PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530
LOSS_EVERY = 50


class Cnn(torch.nn.Module):
    """cnn.h's CnnImpl; the same parameter and buffer names."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 5, padding=2)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 5, padding=2)
        self.bn2 = torch.nn.BatchNorm2d(32)
        self.fc1 = torch.nn.Linear(32 * 7 * 7, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        f = torch.nn.functional
        x = (x.reshape(-1, 1, 28, 28) - PIXEL_MEAN) / PIXEL_STD
        x = f.max_pool2d(f.relu(self.bn1(self.conv1(x))), 2)
        x = f.max_pool2d(f.relu(self.bn2(self.conv2(x))), 2)
        x = f.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def read_idx(path, limit):
    """An IDX file (gzipped or not) as a uint8 tensor; the first `limit` items (0: all)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = list(struct.unpack(">%dI" % ndim, data[4:4 + 4 * ndim]))
    t = torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(dims)
    return t[:limit] if limit > 0 else t


def load_split(data_dir, split, limit):
    """(features float32 [N, 784] in [0, 1], labels int64 [N])."""
    def find(kind):
        for name in ("%s-%s" % (split, kind), "%s-%s.gz" % (split, kind)):
            p = os.path.join(data_dir, name)
            if os.path.exists(p):
                return p
        sys.exit("fashion_mnist_loop: no %s-%s[.gz] in %s" % (split, kind, data_dir))
    images = read_idx(find("images-idx3-ubyte"), limit)
    labels = read_idx(find("labels-idx1-ubyte"), limit)
    return images.reshape(images.shape[0], -1).float().div_(255), labels.long()


def use_deterministic_kernels():
    # cuBLAS reads it when its first handle is made (an existing value is kept).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="folder with the Fashion-MNIST IDX files")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0, help="first N training rows (0: all)")
    ap.add_argument("--test-limit", type=int, default=0, help="first N test rows (0: all)")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU intra-op threads (the example's --threads, default 1)")
    a = ap.parse_args()
    if a.epochs < 1 or a.batch < 1:
        sys.exit("fashion_mnist_loop: --epochs and --batch must be >= 1")
    if a.deterministic:
        use_deterministic_kernels()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("fashion_mnist_loop: --device cuda, but this PyTorch sees no CUDA device")
    device = torch.device("cuda" if a.device != "cpu" and torch.cuda.is_available() else "cpu")
    torch.set_num_threads(a.threads)

    train_x, train_y = load_split(a.data, "train", a.limit)
    test_x, test_y = load_split(a.data, "t10k", a.test_limit)
    torch.manual_seed(a.seed)
    model = Cnn().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    n = train_x.shape[0]
    batches = (n + a.batch - 1) // a.batch
    print("PyTorch %s on %s: %d training rows, %d batches of %d per epoch"
          % (torch.__version__, torch.cuda.get_device_name(device) if device.type == "cuda"
             else "the CPU", n, batches, a.batch))

    # Losses stay on the device until read: sums of (mean loss * rows).
    pending = []
    loss_sum, loss_rows = 0.0, 0

    def read_losses(step):
        nonlocal loss_sum, loss_rows
        for s, l, rows in pending:
            v = l.item()
            if not math.isfinite(v):
                sys.exit("fashion_mnist_loop: the loss is %r at step %d" % (v, s))
            loss_sum += v * rows
            loss_rows += rows
        pending.clear()

    model.train()
    samples, step = 0, 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(a.seed + epoch))
        epoch_loss = 0.0
        for b in range(batches):
            idx = order[b * a.batch:(b + 1) * a.batch]
            x = train_x[idx].to(device)
            y = train_y[idx].to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            samples += idx.shape[0]
            pending.append((step, loss.detach(), idx.shape[0]))
            if step % LOSS_EVERY == 0 or b == batches - 1:
                read_losses(step)
        print("epoch %d/%d  loss %.4f  %.0f samples/s"
              % (epoch + 1, a.epochs, loss_sum / max(loss_rows, 1),
                 samples / (time.perf_counter() - t0)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0

    model.eval()  # the batch norms' running statistics
    correct = 0
    with torch.no_grad():
        for b in range(0, test_x.shape[0], 1000):
            logits = model(test_x[b:b + 1000].to(device))
            correct += int(logits.argmax(1).eq(test_y[b:b + 1000].to(device)).sum().item())
    accuracy = correct / max(test_x.shape[0], 1)
    print("final: strategy=pytorch_loop replicas=1 epochs=%d test_accuracy=%.4f "
          "samples_per_sec=%.0f train_loss=%.4f device=%s"
          % (a.epochs, accuracy, samples / seconds if seconds > 0 else 0.0,
             loss_sum / max(loss_rows, 1), device.type))


if __name__ == "__main__":
    main()
