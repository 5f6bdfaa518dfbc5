"""Adapter to DTensor's own sharding propagation and redistribute planner (private API; the only place this
package touches it).

DTensor knows, for each aten op it supports, which input placements an op accepts as they are and what it then
produces. `propagate` asks it for one op and one set of input layouts on a fake process group (no ranks, no
memory), so autopar's dimension maps can be checked against PyTorch's rules. Queries cost 0.1-5 ms and are cached
by (op, shapes, arguments, layouts, mesh). The default process group must be unset or a fake one of the mesh's size.

`redistribute_steps` asks DTensor's redistribute planner which single-axis moves it makes from one layout to
another (no process group needed), so that the cost model prices a conversion as the runtime makes it where
autopar's own rule of DTensor's order does not reach (`sharding.layout.LayoutCosts`).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from autopar.capture.graph import TENSOR_ARG, TensorInfo
from autopar.sharding.layout import Layout


def _mesh(sizes: tuple[int, ...]) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = math.prod(sizes)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    elif dist.get_world_size() != world or dist.get_backend() != "fake":
        raise RuntimeError(
            f"DTensor rules need a fake process group of {world} ranks; this process already has a "
            f"{dist.get_backend()} group of {dist.get_world_size()}"
        )
    return init_device_mesh("cpu", sizes)


@lru_cache(maxsize=None)
def _cached_mesh(sizes: tuple[int, ...]) -> Any:
    return _mesh(sizes)


def _aten(op: str) -> Any:
    _, name, overload = op.split(".")
    return getattr(getattr(torch.ops.aten, name), overload)


@lru_cache(maxsize=1 << 14)
def propagate(
    op: str, inputs: tuple[TensorInfo, ...], args: tuple, layouts: tuple[Layout, ...], sizes: tuple[int, ...]
) -> tuple[Layout, ...] | None:
    """Output layouts DTensor gives ``op`` on inputs already in ``layouts``; None if it would redistribute them
    first or rejects them (uneven flatten, unsupported op)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor import DTensor

    mesh = _cached_mesh(sizes)
    specs = iter(
        DTensorSpec(mesh, layout, TensorMeta(torch.Size(t.shape), _contiguous_stride(t.shape), getattr(torch, t.dtype)))
        for t, layout in zip(inputs, layouts)
    )

    def fill(a: Any) -> Any:
        if a == TENSOR_ARG:
            return next(specs)
        if isinstance(a, tuple):
            return [fill(x) for x in a]
        return a

    aten = _aten(op)
    propagator = DTensor._op_dispatcher.sharding_propagator
    # the schema info tells DTensor which non-tensor arguments (view sizes, dims) belong in its cache key
    schema = OpSchema(aten, tuple(fill(a) for a in args), {}, schema_info=propagator.op_to_schema_info.get(aten))
    try:
        result = propagator.propagate_op_sharding(schema)
    except (RuntimeError, NotImplementedError, AssertionError, KeyError, ValueError, IndexError):
        return None
    if result.output_spec is None:
        return None
    if result.redistribute_schema is not None:  # also set when DTensor only rewrites view sizes to local ones
        given = [spec for spec in _specs(schema.args_schema)]
        wanted = [spec for spec in _specs(result.redistribute_schema.args_schema)]
        if any(not _same(a.placements, b.placements) for a, b in zip(given, wanted)):
            return None
    out = result.output_spec
    specs_out = out if isinstance(out, (list, tuple)) else (out,)
    return tuple(tuple(s.placements) if s is not None else () for s in specs_out)


def _specs(args: Any) -> list[Any]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    out = []
    for a in args:
        if isinstance(a, DTensorSpec):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_specs(a))
    return out


def _same(given: Layout, wanted: Layout) -> bool:
    """Equal up to local-only changes: DTensor marks replicated embedding indices as a masked Partial, which it
    builds without communication."""
    from torch.distributed.tensor import Partial, Replicate

    for a, b in zip(given, wanted):
        if a == b or (isinstance(a, Replicate) and isinstance(b, Partial) and type(b) is not Partial):
            continue
        return False
    return True


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class _MeshShape:
    """The little of a `DeviceMesh` DTensor's redistribute planner reads: its shape, and this rank's coordinate
    (rank 0's; the steps differ by rank only for splits that do not divide evenly, which layouts never are). No
    process group is needed, so the planner can price conversions in any process, ranks' included."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.shape, self.ndim, self.mesh_dim_names = tuple(sizes), len(sizes), None
        self.device_type = "cpu"

    def size(self, mesh_dim: int | None = None) -> int:
        return math.prod(self.shape) if mesh_dim is None else self.shape[mesh_dim]

    def _sym_get_coordinate(self, mesh_dim: int) -> int:  # noqa: ARG002
        return 0

    def get_coordinate(self) -> list[int]:
        return [0] * self.ndim

    def _is_current_rank_part_of_mesh(self) -> bool:
        return True

    def __hash__(self) -> int:
        return hash(self.shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _MeshShape) and other.shape == self.shape


@lru_cache(maxsize=1 << 12)
def redistribute_steps(sizes: tuple[int, ...], shape: tuple[int, ...], source: Layout,
                       target: Layout) -> tuple[tuple[int, Any, Any], ...] | None:
    """The single-axis moves (mesh axis, placement before, placement after) DTensor's own redistribute takes from
    ``source`` to ``target`` for a tensor of ``shape`` on a mesh of ``sizes``, in order; None where its planner
    does not answer (a private API: a torch without it)."""
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

        mesh = _MeshShape(sizes)
        meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), torch.float32)
        infos = _gen_transform_infos_non_cached(DTensorSpec(mesh, tuple(source), meta),
                                                DTensorSpec(mesh, tuple(target), meta))
    except Exception:  # noqa: BLE001 - any failure of a private API means "no answer", never a wrong one
        return None
    return tuple((info.mesh_dim, *info.src_dst_placements) for info in infos)
