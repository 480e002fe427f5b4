#!/usr/bin/env python3
"""gpu_bench's MLP training step in plain PyTorch: eager, and captured whole in
one CUDA graph. The reference that scripts/gpu-check.sh holds the library's
step to (docs/benchmarks.md, "PyTorch side by side").

The same step as benchmarks/gpu_bench (mlp_step_seconds): an MLP 784-256-256-10
(Linear, ReLU, Linear, ReLU, Linear), the mean softmax cross-entropy of one
fixed batch of 512 rows (features N(0, 1), labels row % 10), plain SGD with
learning rate 0.01 and momentum 0.9; fp32 with TF32 off; the loss read on the
host every 100 steps (and after the last), not every step.

  eager: zero_grad(set_to_none), forward, backward, optimizer.step() per step.
  graph: after a warm-up on a side stream (which creates the momentum buffers:
         torch.optim.SGD has no `capturable` flag, and
         torch.cuda.make_graphed_callables does not capture optimizer.step()),
         forward, backward and step are captured together with
         torch.cuda.graph() over static input tensors, then replayed.

Without CUDA it runs the eager step on the CPU (a few steps prove the script)
and says the graph and the timings are skipped. Works with PyTorch 1.13 and
2.x. Prints one `result key=value` line per figure, as gpu_bench does:

  result device=cuda|cpu
  result pytorch_mlp_eager_step_ms=...
  result pytorch_mlp_graph_step_ms=...      (or =skipped without CUDA)

  python3 benchmarks/pytorch/mlp_step.py [--steps 1000] [--warmup 20] [--device auto|cuda|cpu]
"""
import argparse
import math
import sys
import time

import torch

SIZES = (784, 256, 256, 10)
BATCH = 512
LR, MOMENTUM = 0.01, 0.9
LOSS_EVERY = 100


def make_model(device):
    layers = []
    for i in range(len(SIZES) - 1):
        layers.append(torch.nn.Linear(SIZES[i], SIZES[i + 1]))
        if i + 2 < len(SIZES):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(device)


def has_setting(obj, name):
    """hasattr for torch.backends' objects (1.13's raise AssertionError for unknown names)."""
    try:
        getattr(obj, name)
        return True
    except (AttributeError, AssertionError):
        return False


def tf32_off():
    """fp32 as the library computes it: no TF32 in cuBLAS or cuDNN."""
    matmul = torch.backends.cuda.matmul
    if has_setting(matmul, "fp32_precision"):
        # PyTorch >= 2.9: the per-backend setting; mixing it with the legacy
        # flags below warns, and reading a legacy flag after it can raise.
        matmul.fp32_precision = "ieee"
        conv = getattr(torch.backends.cudnn, "conv", None)
        if conv is not None and has_setting(conv, "fp32_precision"):
            conv.fp32_precision = "ieee"
    else:  # 1.13 .. 2.8
        matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")


def check_loss(value, step):
    if not math.isfinite(value):
        sys.exit("mlp_step: the loss is %r at step %d" % (value, step))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_eager(model, opt, x, y, warmup, steps, device):
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    loss = None
    for i in range(1, steps + 1):
        loss = step()
        if i % LOSS_EVERY == 0 or i == steps:
            check_loss(loss.item(), i)  # the host waits here only
    sync(device)
    return (time.perf_counter() - t0) / steps, loss.item()


def run_graph(model, opt, x, y, warmup, steps, device):
    loss_fn = torch.nn.CrossEntropyLoss()
    static_x, static_y = x.clone(), y.clone()  # what an input pipeline would fill
    # Warm-up on a side stream, as capture requires; it also creates the
    # momentum buffers, so that step() inside the capture allocates nothing new.
    # The capture uses the same stream: cuBLAS(Lt) handles and workspaces are
    # per stream, and one made during capture can fail it.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 3)):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Gradients set to None: backward inside the capture allocates them from
    # the graph's private pool, and they stay there for every replay.
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph, stream=side):
        static_loss = loss_fn(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    sync(device)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        graph.replay()
        if i % LOSS_EVERY == 0 or i == steps:
            check_loss(static_loss.item(), i)
    sync(device)
    return (time.perf_counter() - t0) / steps, static_loss.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="timed steps of each mode")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps before each mode")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                    help="auto: CUDA when available, else the CPU")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0:
        sys.exit("mlp_step: --steps must be >= 1 and --warmup >= 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("mlp_step: --device cuda, but this PyTorch sees no CUDA device")
    device = torch.device("cuda" if a.device != "cpu" and torch.cuda.is_available() else "cpu")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    tf32_off()

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, SIZES[0], generator=gen).to(device)
    y = (torch.arange(BATCH) % SIZES[-1]).to(device)
    print("result device=%s" % device.type)
    print("PyTorch %s, MLP %s, batch %d, SGD lr %g momentum %g, loss read every %d steps, on %s"
          % (torch.__version__, "-".join(map(str, SIZES)), BATCH, LR, MOMENTUM, LOSS_EVERY,
             torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"))

    # Each mode starts from the same initial weights.
    torch.manual_seed(1)
    model = make_model(device)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    eager_s, eager_loss = run_eager(model, opt, x, y, a.warmup, a.steps, device)
    print("eager: %.4f ms/step, %.0f samples/s, loss after %d steps %.6f"
          % (eager_s * 1e3, BATCH / eager_s, a.warmup + a.steps, eager_loss))
    print("result pytorch_mlp_eager_step_ms=%.4f" % (eager_s * 1e3))
    if device.type != "cuda":
        print("graph: skipped (no CUDA)")
        print("result pytorch_mlp_graph_step_ms=skipped")
        return
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    graph_s, graph_loss = run_graph(model, opt, x, y, a.warmup, a.steps, device)
    print("graph: %.4f ms/step, %.0f samples/s, loss after %d steps %.6f"
          % (graph_s * 1e3, BATCH / graph_s, max(a.warmup, 3) + a.steps, graph_loss))
    print("result pytorch_mlp_graph_step_ms=%.4f" % (graph_s * 1e3))


if __name__ == "__main__":
    main()
