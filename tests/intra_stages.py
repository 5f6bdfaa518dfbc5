"""Pipeline plans whose stages lay their layers out block by block, as told (for tests/test_intra_stages.py): the
cost model prices the layouts as written (`cost.intra_layers.IntraLayers.layout_as`), and the plan records them with
each leading module's input and output layouts, as `autopar plan` records the layouts it chooses."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

SEQ = 32
MODELS = {
    "gpt": ("gpt3-125m", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "ffn": 128}),
    "llama": ("llama-7b", {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "ffn": 128}),
    # Hugging Face's own: q, k and v apart, RMSNorm written out (its mean of squares over split features), rotary
    # tables passed to each layer; Qwen3's q and k norms per head
    "hf-llama": ("hf:llama-tiny", {}),
    "hf-qwen3": ("hf:qwen3", {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "ffn": 128}),
}
# larger, for bench/memory.py --laid-out: activations and weights well above the fixed costs
LARGE = {
    "gpt": ("gpt3-125m", {"layers": 4, "hidden": 1024, "heads": 16, "vocab": 8192, "ffn": 4096}),
    "llama": ("llama-7b", {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 8, "vocab": 8192, "ffn": 2816}),
}
LARGE_SEQ = 512


def _model(family: str, *, gpus: int, micro_batch: int, large: bool = False) -> tuple[str, dict, Any, Any]:
    from autopar.capture import trace
    from autopar.cluster import load_cluster
    from autopar.cost.pipeline import PipelineModel
    from autopar.zoo import load

    name, overrides = (LARGE if large else MODELS)[family]
    # the larger model (a memory benchmark, whose plans are applied, not checked against the model's chain) is traced
    # with dropout off, as `autopar run` builds it, so that no dropout mask is priced
    zoo = load(name, batch=micro_batch, seq=LARGE_SEQ if large else SEQ, dtype=torch.float32,
               **({"dropout": 0.0} if large else {}), **overrides)
    graph = trace(zoo.module, example_kwargs=zoo.inputs)
    return name, overrides, zoo, PipelineModel(graph, load_cluster("cpu").with_devices(gpus), traced_batch=micro_batch,
                                               dtype="fp32")  # priced as `autopar run` trains it


def options(family: str, *, tp: int = 2) -> dict[str, list[str]]:
    """Each leading module of the first repeated layer (named inside it) and the splits it may take on tp."""
    from autopar.cost.intra_layers import _relative

    _, _, _, model = _model(family, gpus=tp, micro_batch=2)
    layers = model.intra_layers
    layers._build()
    row = next(r for r in model.layers if r.repeated)
    ic = layers._cost(model._mesh(1, 1, tp).axis("tp"), False)
    return {_relative(model.graph.node(b.leader).module, row.name): [ic.describe(b, c) for c in ic.candidates(b)]
            for b in layers.rows[row.name]}


def plan(family: str, splits: Mapping[str, str], *, pp: int = 1, tp: int = 2, dp: int = 1, micro_batch: int = 2,
         batch: int = 4, recompute: str = "none", zero: int = 0, sp: bool = False,
         large: bool = False) -> dict[str, Any]:
    """The plan (as a dict) of the tiny ``family`` model (``large``: the larger one) in ``pp`` even stages of dp x
    tp devices, every repeated layer laid out by ``splits`` (module inside the layer -> split; `options`),
    recomputed at ``recompute``."""
    from autopar.cost.pipeline import PipelineConfig
    from autopar.plan import Workload
    from autopar.search.pipeline import Found, even_stages, pipeline_plan

    name, overrides, zoo, model = _model(family, gpus=pp * tp * dp, micro_batch=micro_batch, large=large)
    stages = []
    for stage in even_stages(model, pp, tp=tp, dp=dp):
        rows = range(stage.start, stage.end)
        laid = tuple((r, tuple(splits.items())) for r in rows if model.layers[r].repeated)
        levels = tuple(recompute if model.layers[r].repeated else "none" for r in rows)
        stages.append(dataclasses.replace(stage, intra=True, layouts=laid, recompute=levels))
    config = PipelineConfig(stages=tuple(stages), micro_batch=micro_batch, zero=zero, sp=sp)
    result = model.estimate(config, global_batch=batch)
    work = Workload(model=name, overrides=tuple(sorted(overrides.items())), seq=zoo.seq, batch=batch, dtype="fp32")
    return pipeline_plan(model, Found(config, result, 1), name=name, kind="estimate", global_batch=batch,
                         workload=work).to_dict()
