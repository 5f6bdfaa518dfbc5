"""Saved-for-backward bytes from the fake trace equal those of a real CPU forward, per module."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

import autopar
from autopar.zoo import load


def real_saved_bytes_per_module(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """Run a real forward; every storage autograd packs counts once, for the module running when it is packed."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    stack = [""]
    seen: set[int] = set()
    per_module: dict[str, int] = defaultdict(int)

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in state and ptr not in seen:
            seen.add(ptr)
            per_module[stack[-1]] += t.untyped_storage().nbytes()
        return t

    def enter(module: nn.Module, _args: object) -> None:
        stack.append(names.get(id(module), stack[-1]))

    def leave(_module: nn.Module, _args: object, _out: object) -> None:
        stack.pop()

    hooks = [
        nn.modules.module.register_module_forward_pre_hook(enter),
        nn.modules.module.register_module_forward_hook(leave),
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    loss = getattr(loss, "loss", loss)  # Hugging Face models return an output object
    loss.backward()  # the model really trains: what was saved is what backward used
    return dict(per_module)


def traced_saved_bytes_per_module(graph: autopar.Graph) -> dict[str, int]:
    per_module: dict[str, int] = defaultdict(int)
    for node in graph.nodes:
        if node.saved_bytes:
            per_module[node.module] += node.saved_bytes
    return dict(per_module)


TINY = {
    "gpt3-125m": dict(layers=3, hidden=64, heads=4, vocab=128),
    "llama-7b": dict(layers=3, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128),
    "t5-base": dict(layers=2, hidden=64, heads=4, head_dim=16, ffn=96, vocab=128),
    "moe-125m-e8": dict(layers=4, hidden=64, heads=4, vocab=128, experts=4),
    "bert-base": dict(layers=3, hidden=64, heads=4, vocab=128),
    "wrn-50-2": dict(hidden=8, vocab=10),
}


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_match_real_cpu_forward(name: str, dtype: torch.dtype) -> None:
    seq = 32 if name != "wrn-50-2" else 32
    torch.manual_seed(0)
    real = load(name, batch=2, seq=seq, dtype=dtype, device="cpu", **TINY[name])
    for p in real.module.parameters():
        nn.init.normal_(p, std=0.02)
    expected = real_saved_bytes_per_module(real.module, real.inputs)

    meta = load(name, batch=2, seq=seq, dtype=dtype, device="meta", **TINY[name])
    graph = autopar.trace(meta.module, example_kwargs=meta.inputs)

    assert traced_saved_bytes_per_module(graph) == expected
    assert sum(expected.values()) > 0
    layers = {row.name: row.saved_bytes for row in graph.layers()}
    assert sum(layers.values()) == sum(expected.values())


def test_hf_llama_saved_bytes_match_real_cpu_forward() -> None:
    pytest.importorskip("transformers")
    real = load("hf:llama-tiny", batch=2, seq=32, dtype=torch.float32, device="cpu")
    for p in real.module.parameters():
        nn.init.normal_(p, std=0.02)
    expected = real_saved_bytes_per_module(real.module, real.inputs)
    meta = load("hf:llama-tiny", batch=2, seq=32, dtype=torch.float32)
    graph = autopar.trace(meta.module, example_kwargs=meta.inputs)
    assert traced_saved_bytes_per_module(graph) == expected


def test_real_model_is_traced_without_touching_its_weights() -> None:
    real = load("gpt3-125m", batch=2, seq=16, dtype=torch.float32, device="cpu", layers=2, hidden=32, heads=2)
    before = {n: p.detach().clone() for n, p in real.module.named_parameters()}
    graph = autopar.trace(real.module, example_kwargs=real.inputs)
    assert graph.num_params == sum(p.numel() for p in real.module.parameters())
    for n, p in real.module.named_parameters():
        assert not isinstance(p, torch._subclasses.FakeTensor)
        torch.testing.assert_close(p.detach(), before[n])
