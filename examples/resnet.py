"""ResNet-18 (torchvision's layout, written out here): plan it at scale, run a small copy on gloo processes.

torchvision cannot be installed beside this project's torch pin, so `resnet18`
rebuilds its ``resnet18``: the same modules under the same names (``conv1``,
``bn1``, ``layer1.0.conv1``, ``layer2.0.downsample.0``, ``fc``...), the same
``BasicBlock`` with in-place ReLUs and ``out += identity``, and the same
initialisation. ``width`` scales every channel count (torchvision's is 64) so
that a test can run the real layer structure in a second.

Batch norm in training mode is the interesting op: capture writes it out as
per-channel sums, so splitting the batch all-reduces the statistics
(synchronised batch norm) and the running statistics every rank keeps equal
the single-device model's. `buffer_errors` checks exactly that.

``python examples/resnet.py`` plans ResNet-18 for 32 images of 224x224 on
``Mesh("2")`` under the H100 profile, then replays that plan on a ResNet-18
of width 8 on two gloo processes and checks outputs, gradients and buffers.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, and the identity (or a strided 1x1 projection) added back."""

    expansion = 1

    def __init__(self, cin: int, cout: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ``ResNet`` for ``BasicBlock``: stem, four stages, global average pool, classifier."""

    def __init__(self, layers=(2, 2, 2, 2), num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * BasicBlock.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * BasicBlock.expansion, stride),
                                       nn.BatchNorm2d(planes * BasicBlock.expansion))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * BasicBlock.expansion
        layers += [BasicBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000, width: int = 64) -> ResNet:
    """torchvision's ``resnet18`` (random weights); ``width=64`` is the published model."""
    return ResNet((2, 2, 2, 2), num_classes=num_classes, width=width)


def small(seed: int = 0):
    """A ResNet-18 of width 8 with 10 classes and 4 images of 32x32, in float64: the same on every rank.

    float64 because capture writes batch norm out as its formula: in float32
    the formula and ATen's fused kernel round differently, and through 20
    batch norms the gradients of the sum of the logits differ by ~1e-4 even on
    one device; in float64 they agree to ~1e-13, so any larger error is a
    wrong plan, not rounding.
    """
    torch.manual_seed(seed)
    return resnet18(num_classes=10, width=8).double(), (torch.randn(4, 3, 32, 32, dtype=torch.float64),)


def buffer_errors(model: nn.Module, plan, inputs, rank: int, steps: int = 2) -> float:
    """Largest error of any buffer (running statistics, batch counts) after ``steps`` training steps.

    Each step is a forward and a backward of the summed outputs, on this
    rank's program and on a copy of the single-device model; buffers are
    replicated, so every rank's must equal the single-device model's whole.
    """
    from autotp import parallelize
    from autotp.runtime.verify import scaled_error

    reference, local = copy.deepcopy(model), parallelize(copy.deepcopy(model), plan, rank=rank)
    for _ in range(steps):
        for module in (reference, local):
            out = module(*inputs)
            out = out if isinstance(out, (tuple, list)) else (out,)
            sum(t.sum() for t in out if t.is_floating_point()).backward()
    want = dict(reference.named_buffers())
    got = dict(local.named_buffers())
    missing = sorted(set(want) - set(got))
    if missing:
        raise AssertionError(f"buffers missing from the parallel module: {missing}")
    return max((scaled_error(got[name].float(), want[name].float()) for name in want), default=0.0)


MESH_SHAPE = "2"


def _with_float64(name: str) -> dict:
    """A shipped profile with a float64 peak added, for the float64 replay (its choices are fixed by the plan)."""
    import json

    profile = json.loads((Path(__file__).parents[1] / "cost_models" / f"{name}.json").read_text())
    profile["device"]["peak_flops"]["float64"] = 67e12  # H100 SXM FP64 tensor cores (NVIDIA datasheet)
    return profile


def check_rank(rank, world, plan):
    """One rank's max errors of outputs, gradients and BatchNorm buffers against one device."""
    from autotp.runtime.verify import max_errors

    model, inputs = small()
    errors = max_errors(model, plan, inputs, rank)
    model, inputs = small()
    errors["buffers"] = buffer_errors(model, plan, inputs, rank)
    return errors


def main() -> None:
    import autotp
    from autotp.runtime import spawn
    from autotp.solve.constraints import same_as

    started = time.perf_counter()
    mesh = autotp.Mesh(MESH_SHAPE)
    with torch.device("meta"):
        large = resnet18()
    plan = autotp.plan(large, mesh, (torch.zeros(32, 3, 224, 224, device="meta"),))
    print(plan.summary())
    print(f"\nplanned ResNet-18 ({plan.ilp['ops']} ops) in {plan.stats['plan_s']:.1f} s; "
          f"fallback ops: {plan.fallback_ops or 'none'}\n")
    model, inputs = small()
    small_plan = autotp.plan(model, mesh, inputs, allow=same_as(plan), profile=_with_float64("h100-hgx"))
    errors = spawn(check_rank, mesh.size, small_plan, timeout_s=900)
    worst = {key: max(e[key] for e in errors) for key in ("output", "gradient", "buffers")}
    print(f"resnet18 (width 8) on {mesh.size} gloo processes: max output error {worst['output']:.2e}, "
          f"max gradient error {worst['gradient']:.2e}, max buffer error {worst['buffers']:.2e} "
          f"({errors[0]['parameters']} parameters) in {time.perf_counter() - started:.0f} s")
    if max(worst.values()) > 1e-5:
        raise SystemExit("resnet18: the parallel model does not match the single-device model")


if __name__ == "__main__":
    main()
