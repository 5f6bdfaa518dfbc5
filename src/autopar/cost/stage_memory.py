"""A pipeline stage's peak memory as the runtime allocates it, from a `autopar.cost.pipeline.PipelineModel`'s rows.

The terms are `autopar.cost.memory`'s; this builds what they read for one stage of a configuration: its rows in the
order the backward meets them (each one's activations at its recomputation level, its backward walked op by op,
its parameters, like rows one after another as one run), the wrapper that holds its states, its micro-batches in
flight, its module buffers and the pipeline schedule's buffers. What runs after the last repeated layer (the loss,
and the head and norm that feed it) is the last stage's, where the runtime computes it, whichever stage the chain
of rows puts it in. Rows, runs and stages are cached by their shape, so a search pricing thousands of
configurations walks each shape once.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING

from autopar.cost.checkpoint import SegmentCosts
from autopar.cost.memory import (
    RowMemory, RowPeak, ScheduleBuffers, StageLoad, held_bytes, holding, row_peak, stage_peak,
)
from autopar.plan.estimate import MemoryBreakdown

if TYPE_CHECKING:
    from autopar.cost.pipeline import PipelineConfig, PipelineModel, Stage, StageView


class StageMemoryModel:
    """Peaks of one `PipelineModel`'s stages (`peak`), and the budget its recomputation searches use (`held`)."""

    def __init__(self, model: PipelineModel) -> None:
        self.model = model
        self._row_peaks: dict[tuple, tuple] = {}  # a row's saved bytes and backward peaks, by its shape on a device
        self._row_memories: dict[tuple, RowMemory] = {}  # a row on a device, by its shape there
        self._memories: dict[tuple, MemoryBreakdown] = {}  # a stage's peak, by what it depends on
        self._loads: dict[tuple, tuple] = {}  # a stage's rows and their walks, by what they depend on

    def peak(self, config: PipelineConfig, index: int, view: StageView, *, micro_batches: int,
             copy: float = 0.0, segments: SegmentCosts | None = None) -> MemoryBreakdown:
        """Peak bytes on one device of stage ``index`` as the runtime holds them (`autopar.cost.memory.stage_peak`),
        the device reserve apart; ``copy``: parameters of a tied weight's copy the stage holds."""
        stage = config.stages[index]
        last = index == len(config.stages) - 1
        onward = None if last else self.model._boundary_bytes(config.stages[index + 1], config)
        key = (self.model.stage_key(stage), onward, index == 0, len(config.stages) == 1, config.micro_batch,
               config.zero, config.sp, micro_batches, view.in_flight, view.samples, copy,
               view.mesh if view.layouts else None, config.ep)
        found = self._memories.get(key)
        if found is None:
            peak = stage_peak(self._stage_load(config, index, view, micro_batches=micro_batches, copy=copy,
                                               segments=segments))
            device = self.model.cluster.device
            found = self._memories[key] = MemoryBreakdown(
                parameters=peak.parameters, gradients=peak.gradients, optimizer=peak.optimizer,
                activations=peak.activations, other=peak.other, reserve=device.reserved, budget=device.memory)
        return found

    def held(self, config: PipelineConfig, index: int, *, global_batch: int) -> tuple[float, float]:
        """What one device of stage ``index`` holds besides activations and transients while every activation is
        held (`autopar.cost.memory.held_bytes`: model states as the runtime keeps them, its wrappers' and the
        schedule's buffers, gradients of earlier micro-batches), or infinity where the end of the step does not fit
        in any case; and the largest transient of what the backward meets before the layers (the loss's). A
        recomputation choice fits where its activations and the larger of that and its layers' transients fit in
        the rest."""
        view = self.model.stage_view(config, index, global_batch=global_batch)
        copy = sum(size for size, holds_copy in self.model._tied_copies(config).get(index, []) if holds_copy)
        load = self._stage_load(config, index, view, micro_batches=global_batch // config.micro_batch, copy=copy,
                                segments=None)
        held, transient, end = held_bytes(load)
        device = self.model.cluster.device
        return (held if end <= device.memory - device.reserved else math.inf), transient

    def _stage_load(self, config: PipelineConfig, index: int, view: StageView, *, micro_batches: int, copy: float,
                    segments: SegmentCosts | None) -> StageLoad:
        stage = config.stages[index]
        last = index == len(config.stages) - 1
        # an intra-op stage's layouts are chosen for its mesh, ZeRO stage and micro-batches (`_stage_layouts`)
        chosen_for = (view.mesh, config.zero, micro_batches, view.in_flight) if view.layouts else None
        key = (self.model.stage_key(stage), last, config.sp, view.samples, copy, segments is None, chosen_for,
               config.ep)
        found = self._loads.get(key)
        if found is None:  # its rows, and their walks (`autopar.cost.memory.walk`), for every place it stands
            found = self._loads[key] = (self._memory_rows(config, index, view, copy=copy, segments=segments), {})
        rows, walks = found
        return StageLoad(
            rows=rows, walks=walks, precision=self.model.precision,
            holding=holding(dp=stage.dp, tp=stage.tp, stages=len(config.stages), zero=config.zero),
            zero=config.zero, dp=stage.dp, micro_batches=micro_batches, in_flight=view.in_flight,
            later_in_flight=view.in_flight, kept_outputs=view.in_flight if last else 0.0,
            buffers=self._buffer_bytes(stage), schedule=self._schedule_buffers(config, index),
        )

    def _memory_rows(self, config: PipelineConfig, index: int, view: StageView, *, copy: float,
                     segments: SegmentCosts | None) -> tuple[RowMemory, ...]:
        """The stage's rows for `stage_peak`, in the order the backward meets them (by each one's last op). What
        runs after the last repeated layer (the loss, and the head and norm that feed it) is the last stage's,
        where the runtime computes it, whichever stage the chain puts its row in; a tied weight's copy is met
        with the head; a checkpointed run is one row."""
        stage = config.stages[index]
        last = index == len(config.stages) - 1
        parts: list[tuple[int, int, RowMemory, int]] = []  # (id of the op the backward meets it at, row, part, count)
        split, signature, met = self._split_rows, self.model._signature, self._met_at
        runs = {start: (end, kept, peak) for start, end, kept, peak in (segments.runs if segments else ())}
        # like rows one after another, where no checkpointed run starts among them (the model's `_alike_rows`)
        alike = None if runs or self.model._runs is None else dict(self.model._alike_rows(stage, view.layouts))
        row = stage.start
        while row < stage.end:  # like rows one after another (a run of repeated layers) are priced once
            if row in runs:  # a checkpointed run: its input kept, its rows' activations again as it replays
                end, kept, peak = runs[row]
                parts.append((met[end - 1], row, self._run_memory(row, end, kept, peak, config, stage, view), 1))
                row = end
                continue
            if row in split:
                row += 1
                continue
            level = stage.recompute_of(row)
            if alike is not None:
                end = row + alike[row]
            else:
                end = row + 1
                while end < stage.end and signature[end] == signature[row] and end not in split \
                        and stage.recompute_of(end) == level and view.layouts.get(end) is view.layouts.get(row):
                    end += 1
            parts.append((met[end - 1], row, self._row_memory(row, None, config, stage, view), end - row))
            row = end
        for row in split:
            lead, tail = self._halves(row)
            mine = stage.start <= row < stage.end
            if mine and lead:
                parts.append((lead[-1].id, row, self._row_memory(row, "lead", config, stage, view), 1))
            if last:
                part = self._row_memory(row, "tail", config, stage, view)
                parts.append((tail[-1].id, row, part if mine and not lead else replace(part, params=0.0), 1))
        for reader, owner, size in self.model._tied:  # a weight read twice on this device: its gradients summed
            if stage.start <= reader < stage.end and stage.start <= owner < stage.end:
                size = size / stage.tp if self.model.vocab_parallel else size  # split by vocabulary over tp
                for k, (key, row, part, count) in enumerate(parts):
                    if row in (reader, owner) and count == 1:
                        parts[k] = (key, row, replace(part, shared=part.shared + size * (row == reader),
                                                      summed=part.summed + size * (row == owner)), 1)
                        reader, owner = (-1 if row == reader else reader), (-1 if row == owner else owner)
        parts.sort(key=lambda p: (p[0], p[1]), reverse=True)
        ordered = [part if count == 1 else replace(part, count=count) for _, _, part, count in parts]
        if copy:  # its gradient is made with the head's, early in the backward
            made = RowPeak(gradients=copy * self.model.precision.gradient)
            ordered.insert(sum(1 for key, _, _, _ in parts if key >= (self._tail_start or 0)),
                           RowMemory(activations=0.0, params=copy, kept=made, added=made))
        return tuple(ordered)

    def _run_memory(self, start: int, end: int, kept: float, peak: float, config: PipelineConfig, stage: Stage,
                    view: StageView) -> RowMemory:
        """A checkpointed run of rows [start, end) as one row: it keeps ``kept`` (its input), and while its
        backward runs holds ``peak`` of replayed activations (`autopar.cost.checkpoint`), with its rows' gradients
        and the largest of their transients."""
        rows = [self._row_memory(row, None, config, stage, view) for row in range(start, end)]
        params = sum(row.params for row in rows)
        transient = max(row.kept.transient for row in rows)
        return RowMemory(
            activations=kept, params=params, unit=all(row.unit for row in rows), local=sum(row.local for row in rows),
            kept=RowPeak(saved=peak, gradients=params * self.model.precision.gradient, transient=transient),
            added=RowPeak(saved=peak, transient=transient))

    def _row_memory(self, row: int, half: str | None, config: PipelineConfig, stage: Stage,
                    view: StageView) -> RowMemory:
        """Row ``row`` (or its ``lead`` or ``tail`` half, `_halves`) on one device of ``stage``: its activations
        at its recomputation level, and its backward's peak walked op by op (`autopar.cost.memory.row_peak`; a row
        the intra-op planner lays out, by its price)."""
        layer = self.model.layers[row]
        level = stage.recompute_of(row) if stage.start <= row < stage.end else "none"
        scale, g = view.samples / self.model.traced_batch, self.model.precision.gradient
        # Megatron's row, changed by what a layout, or expert parallelism, keeps, holds and passes through
        if row in view.layouts or (config.ep > 1 and half is None and self.model.expert_groups[row]):
            price = view.price(row, level)
            megatron = self.model.price(row, tp=stage.tp, samples=view.samples, recompute=level, sp=config.sp,
                                        mesh=view.mesh)
            plain = self._row_memory(row, None, replace(config, ep=1), stage, replace(view, layouts={}))
            kept_more, held_more = price.activations - megatron.activations, (price.params - megatron.params) * g
            passed_more = price.temporary - megatron.temporary

            def changed(peak: RowPeak, grads: float) -> RowPeak:
                return RowPeak(saved=max(0.0, peak.saved + kept_more), gradients=max(0.0, peak.gradients + grads),
                               transient=max(0.0, peak.transient + passed_more))

            # expert parallelism: the device's own experts (1 / ep of the row's), outside FSDP and the all-reduces
            local = self.model.row_expert_params(row) / config.ep if config.ep > 1 else 0.0
            return RowMemory(activations=price.activations, params=price.params, unit=layer.repeated,
                             kept=changed(plain.kept, held_more), added=changed(plain.added, 0.0), local=local)
        key = ((self.model._signature[row], self.model.intra_layers.price_key(row)) if half is None else row, half,
               stage.tp, config.sp, view.samples, view.mesh.axis("tp"), level)
        memory = self._row_memories.get(key)
        if memory is not None:
            return memory
        # Megatron's price, which a layout's row is measured from too (a view without layouts still prices by them)
        price = self.model.price(row, tp=stage.tp, samples=view.samples, recompute=level, sp=config.sp, mesh=view.mesh)
        found = self._row_peaks.get(key[:-1])
        if found is None:  # its ops as the block model lays them out (`IntraLayers.row_memory`)
            saved, passing, params = self.model.intra_layers.row_memory(row, view.mesh.axis("tp"), sp=config.sp)
            if half is not None:
                lead = len(self._halves(row)[0])
                part = slice(None, lead) if half == "lead" else slice(lead, None)
                saved, passing, params = saved[part], passing[part], params[part]
            saved, passing = [x * scale for x in saved], [x * scale for x in passing]
            grads = [size * g for size in params]
            found = self._row_peaks[key[:-1]] = (
                sum(saved), *(row_peak(saved, passing, grads, keep=keep) for keep in (True, False)))
        saved, kept, added = found
        activations = price.activations if half is None else saved  # a split row recomputes nothing
        memory = self._row_memories[key] = RowMemory(
            activations=activations, params=price.params if half != "tail" or not self._halves(row)[0] else 0.0,
            kept=kept, added=added, unit=layer.repeated)
        return memory

    @cached_property
    def _met_at(self) -> list[int]:
        """Per row, the id of the op whose backward meets it first: its last op, or for a row that runs none (a
        position table its parent slices) the last op reading its parameters; -1 for neither."""
        rows = {layer.name: row for row, layer in enumerate(self.model.layers)}
        met = [layer.nodes[-1].id if layer.nodes else -1 for layer in self.model.layers]
        idle = {row for row, layer in enumerate(self.model.layers) if not layer.nodes}
        if idle:
            for node in self.model.graph.nodes:
                for source in node.sources:
                    row = rows.get(self.model.graph.layer_of(source.state.rpartition(".")[0])) if source.state else None
                    if row in idle:
                        met[row] = max(met[row], node.id)
        return met

    @cached_property
    def _split_rows(self) -> frozenset[int]:
        """Rows with ops after the last repeated layer (`_halves`)."""
        return frozenset(row for row in range(len(self.model.layers)) if self._halves(row) is not None)

    @cached_property
    def _tail_start(self) -> int | None:
        """Id of the first op after the last repeated layer (None: the model repeats no layer)."""
        ends = [layer.nodes[-1].id for layer in self.model.layers if layer.repeated and layer.nodes]
        return max(ends) + 1 if ends else None

    def _halves(self, row: int) -> tuple[list, list] | None:
        """A row not repeated that runs ops after the last repeated layer (the root's loss after its embedding
        sum; a head and its norm, whole), split there into its ops before and after; None for other rows."""
        start, layer = self._tail_start, self.model.layers[row]
        if start is None or layer.repeated or not layer.nodes or layer.nodes[-1].id < start:
            return None
        return [n for n in layer.nodes if n.id < start], [n for n in layer.nodes if n.id >= start]

    def _buffer_bytes(self, stage: Stage) -> float:
        """Module buffers one device of ``stage`` holds, whole: its repeated layers' own, and every other buffer of
        the model (rotary tables), which the runtime gives each stage."""
        shared, own = self._buffers
        return shared + sum(nbytes for row, nbytes in own.items() if stage.start <= row < stage.end)

    @cached_property
    def _buffers(self) -> tuple[float, dict[int, float]]:
        """Bytes of the model's buffers: those outside repeated layers, and per repeated layer its own."""
        rows = {layer.name: row for row, layer in enumerate(self.model.layers)}
        shared, own = 0.0, {}
        for info in self.model.graph.state.values():
            if info.is_buffer:
                row = rows.get(self.model.graph.layer_of(info.fqn.rpartition(".")[0]))
                if row is None or not self.model.layers[row].repeated:
                    shared += info.tensor.nbytes
                else:
                    own[row] = own.get(row, 0.0) + info.tensor.nbytes
        return shared, own

    def _schedule_buffers(self, config: PipelineConfig, index: int) -> ScheduleBuffers:
        """Per micro-batch buffers the pipeline schedule keeps on stage ``index`` (none for a single stage)."""
        virtual = len(config.stages)
        if virtual == 1:
            return ScheduleBuffers()
        stage = config.stages[index]
        scale = config.micro_batch / stage.dp / self.model.traced_batch
        received = self.model._boundary_bytes(stage, config) * scale if index > 0 else 0.0
        onward = self.model._boundary_bytes(config.stages[index + 1], config) * scale if index < virtual - 1 else 0.0
        output = self._output_bytes * scale if index == virtual - 1 else 0.0
        return ScheduleBuffers(received=received, received_gradient=onward, output=output)

    @cached_property
    def _output_bytes(self) -> float:
        """Bytes of what the model's last module returns (the logits the loss reads), at the traced batch."""
        node = next((n for n in reversed(self.model.graph.nodes) if n.module), None)
        return float(sum(t.nbytes for t in node.outputs if t.dtype.startswith(("float", "bfloat")))) if node else 0.0
