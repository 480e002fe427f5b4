"""Loads a diststrat checkpoint of the LibTorch test model into the equivalent
Python torch.nn.Module and checks that it gives the C++ logits on the same
batch. Usage: check_checkpoint.py CKPT BATCH_F32 LOGITS_F32 ROWS
The safetensors file is parsed here (8-byte little-endian header length, JSON
header, raw little-endian data): Debian has no python3-safetensors. When
Python's safetensors is importable too (scripts/setup.sh pip-installs it into
.deps/python), safetensors.torch.load_file must give the same tensors."""
import json
import struct
import sys

import torch
from torch import nn

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
          "BF16": torch.bfloat16, "I32": torch.int32, "I64": torch.int64}


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        if end > begin:
            t = torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=dtype)
        else:
            t = torch.zeros(0, dtype=dtype)
        out[name] = t.reshape(info["shape"])
    return out


class Net(nn.Module):  # tests/torch/torch_test_util.h's NetImpl
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def main():
    ckpt, batch_path, logits_path, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    tensors = load(ckpt)
    try:
        import safetensors.torch
        other = safetensors.torch.load_file(ckpt)
        assert other.keys() == tensors.keys(), "safetensors.torch sees other names"
        for k in tensors:
            assert torch.equal(other[k], tensors[k]), "safetensors.torch differs on " + k
        print("safetensors.torch agrees")
    except ImportError:
        pass
    net = Net()
    model = {k: v for k, v in tensors.items() if "/" not in k}  # optimizer state has '/'
    net.load_state_dict(model, strict=True)
    x = torch.frombuffer(bytearray(open(batch_path, "rb").read()), dtype=torch.float32).reshape(rows, 8)
    want = torch.frombuffer(bytearray(open(logits_path, "rb").read()), dtype=torch.float32).reshape(rows, 4)
    with torch.no_grad():
        got = net(x)
    diff = (got - want).abs().max().item()
    print("max abs logits difference %g" % diff)
    if diff > 1e-6:
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
