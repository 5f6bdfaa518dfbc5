"""Wide-ResNet (Zagoruyko & Komodakis; torchvision's bottleneck layout): ``wrn-<depth>-<width factor>``.

Config mapping: ``layers`` is the depth (50, 101, 152, 200, or any 3n+2), ``hidden`` the stem width (64),
``width`` the widening factor of the bottleneck 3x3 convolutions, ``seq`` the image side, ``vocab`` the classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo.config import ModelConfig

STAGE_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3), 200: (3, 24, 36, 3)}


def stage_blocks(depth: int) -> tuple[int, int, int, int]:
    if depth in STAGE_BLOCKS:
        return STAGE_BLOCKS[depth]
    blocks = (depth - 2) // 3
    if (depth - 2) % 3 or blocks < 11:
        raise ValueError(f"wide-resnet depth {depth} is not 3n+2 with n >= 11 (e.g. 50, 101, 152, 200)")
    return (3, 4, blocks - 10, 3)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, *, width: int, stride: int) -> None:
        super().__init__()
        mid = planes * width
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class WideResNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        base = cfg.hidden
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(base), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        stages, inplanes = [], base
        for i, blocks in enumerate(stage_blocks(cfg.layers)):
            planes = base * 2**i
            stage = []
            for b in range(blocks):
                stage.append(Bottleneck(inplanes, planes, width=cfg.width, stride=2 if i and not b else 1))
                inplanes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(inplanes, cfg.vocab)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(images))
        return F.cross_entropy(self.fc(x.mean(dim=(2, 3))), labels)
