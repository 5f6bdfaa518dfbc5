"""Pipeline stages of a model of one's own: its ``forward`` traced at the plan's rows and cut between stages.

A model no chain of `autopar.runtime.pipeline.HF_CHAINS` describes (a plain PyTorch model, in the style users
write) is cut by what its own ``forward`` does. That forward is traced symbolically (``torch.fx``) down to the
plan's rows: a module that is a row, or lies inside one, is called whole (its own code is never traced), a module
holding rows is traced through (a wrapper around the model, an ``nn.Sequential`` of layers). Each call of a row's
module runs on the stage the plan gives the row, as do reads of a row's parameters; what else the forward
computes (a sum of embeddings, a dropout, a reshape) runs on the stage that needs it, a part of an output (an item
of a tuple) with what made it. The stages' graphs replay the traced forward's own calls, in its order, so a
pipeline trains what the forward computes.

What one stage hands the next must be one value, and the loss must read one value of the last stage and the
labels (the forward's other input). A cut anywhere else is refused, naming the module or value and the stage:
another kind of forward (two streams, a mask made from the inputs that every layer reads, control flow on tensor
values the tracer cannot follow) cannot be cut there. Buffers, and what is computed from them and constants alone,
are copied to every stage that reads them; parameters are held by the stage of their row, once.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

LOSS = -1  # the stage of what runs in the loss function (after the last stage, on the same rank)


@dataclass
class Cut:
    """A traced forward cut into stages: each stage's graph (its input, the value it hands on), what each reads
    from the model (module and parameter names), the loss's graph (the last stage's value, the labels) and the
    names of the forward's two inputs (the first stage's, the loss's)."""

    graphs: list[fx.Graph]
    reads: list[list[str]]
    loss: fx.Graph
    loss_reads: list[str]
    first: str
    target: str


class _Tracer(fx.Tracer):
    """Traces through the modules that hold rows; calls every other module whole (a row, a module inside one, or
    one no row names). Asserts become graph nodes; buffers read as attributes are traced as parameters are (a
    rotary table sliced by the traced sequence length)."""

    proxy_buffer_attributes = True

    def __init__(self, rows: Iterable[str]) -> None:
        super().__init__()
        self.rows = [row for row in rows if row]

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        name = module_qualified_name
        return not any(row.startswith(f"{name}.") for row in self.rows)

    def to_bool(self, obj: fx.Proxy) -> bool:
        """An ``assert`` on a traced value (nanoGPT's on the sequence length) becomes an assert node that holds; any
        other branch on one cannot be traced. (torch.fx's own ``trace_asserts`` reads Python 3.10's bytecode.)"""
        import dis
        import inspect

        frame = inspect.currentframe()
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if caller is not None:
            insts = list(dis.get_instructions(caller.f_code))
            at = next((i for i, inst in enumerate(insts) if inst.offset == caller.f_lasti), None)
            if at is not None and at + 1 < len(insts) and "IF_TRUE" in insts[at].opname \
                    and insts[at + 1].opname == "LOAD_ASSERTION_ERROR":
                self.create_proxy("call_function", torch._assert, (obj, "assert"), {})
                return True
        return super().to_bool(obj)


def trace(model: nn.Module, rows: Iterable[str]) -> fx.Graph:
    """``model``'s forward traced down to ``rows`` (`_Tracer`); NotImplementedError where it cannot be."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # a trace under a fake tensor mode (a rehearsal) reads the real generator
        state = torch.random.get_rng_state()
    try:
        graph = _Tracer(rows).trace(model)
    except Exception as exc:  # noqa: BLE001 - whatever the tracer met: this forward cannot be cut here
        text = str(exc).strip().splitlines()
        raise NotImplementedError(
            f"pipeline stages of {type(model).__name__} cannot be cut: its forward cannot be traced symbolically "
            f"between its layers ({type(exc).__name__}: {text[0] if text else ''}{_where(exc)}); plan without "
            "pipeline parallelism") from None
    finally:
        with unset_fake_temporarily():
            drew = not torch.equal(state, torch.random.get_rng_state())
            torch.random.set_rng_state(state)
    if drew:  # a draw whose shape the tracer knew: made once while tracing, it would be replayed as a constant
        raise NotImplementedError(
            f"pipeline stages of {type(model).__name__} cannot be cut: its forward draws random numbers between its "
            "modules from values known before it runs (a tensor of fixed shape), which the stages would draw once "
            "and replay every step; draw them inside a module, or plan without pipeline parallelism")
    return graph


def _where(exc: BaseException) -> str:
    """`` at file:line`` of the model's own code the tracer stopped in (the innermost frame outside torch and
    autopar), or ""."""
    import traceback
    from pathlib import Path

    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parent.parent))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(skip)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _row_of(target: str, rows: dict[str, int]) -> str | None:
    """The row holding the module or attribute ``target`` (a dotted name), or None."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if name in rows:
            return name
    return "" if "" in rows and len(parts) == 1 else None


@dataclass
class _Placed:
    """Every node of a traced forward on a stage (`LOSS`: the loss), and the values crossing each boundary."""

    nodes: list[fx.Node]
    stage: dict[fx.Node, int]
    crossing: list[list[fx.Node]]  # boundary b (after stage b; the last one into the loss) -> what crosses it
    constant: set[fx.Node]
    source: fx.Node
    target: fx.Node
    result: fx.Node


def cut(model: nn.Module, stages: list[list[str]], *, graph: fx.Graph | None = None) -> Cut:
    """``model``'s forward cut at ``stages`` (each stage's rows, in order); NotImplementedError naming the module
    or value and the stage where it cannot be. ``graph``: the forward already traced at these rows (`trace`)."""
    graph = trace(model, {row for rows in stages for row in rows}) if graph is None else graph
    try:
        return _cut(model, _place(model, stages, graph, late=True))
    except NotImplementedError as late:
        try:  # what the forward computes between modules, run as early as its inputs allow instead
            return _cut(model, _place(model, stages, graph, late=False))
        except NotImplementedError:
            raise late from None


def _cut(model: nn.Module, placed: _Placed) -> Cut:
    stage, last = placed.stage, len(placed.crossing) - 1

    def at(n: fx.Node) -> int:  # a user's stage, the loss counting as after the last
        return last + 1 if stage[n] == LOSS else stage[n]

    for n in placed.nodes:
        for a in n.all_input_nodes if n in stage and n is not placed.source else ():
            if a in stage and a is not placed.target and at(a) > at(n):
                where = "the loss" if stage[n] == LOSS else f"stage {stage[n]}"
                raise _refusal(model, f"{_what(n)} on {where} reads {_what(a)}, computed on stage {stage[a]} after it")
    for boundary, values in enumerate(placed.crossing):
        if len(values) != 1:
            after = "the loss" if boundary == last else f"stage {boundary + 1}"
            raise _refusal(model, f"{after} reads {len(values)} values from the stages before it "
                                  f"({', '.join(_what(v) for v in values) or 'none'}); one stage hands the next one "
                                  "value")
    crossing = [values[0] for values in placed.crossing]
    graphs, reads = [], []
    for s in range(last + 1):
        handed = placed.source if s == 0 else crossing[s - 1]
        members = [n for n in placed.nodes if n in stage and stage[n] == s and n is not handed]
        built, read = _graph([handed], members, crossing[s], placed.constant)
        graphs.append(built)
        reads.append(read)
    members = [n for n in placed.nodes if stage.get(n) == LOSS]
    loss, loss_reads = _graph([crossing[last], placed.target], members, placed.result, placed.constant)
    return Cut(graphs=graphs, reads=reads, loss=loss, loss_reads=loss_reads, first=placed.source.target,
               target=placed.target.target)


def cut_points(model: nn.Module, rows: list[str]) -> list[int]:
    """The places ``k`` (0 < k < len(rows)) where ``model``'s forward can be cut between ``rows[k - 1]`` and
    ``rows[k]`` (rows in the order the forward runs them), in one pass: what crosses a boundary does not depend on
    where the other boundaries are (a value runs on the stage of its first reader, or with its inputs), so each
    row is placed on a stage of its own and the boundaries that one value crosses are those a cut can use. Empty
    where the forward cannot be traced or cut anywhere."""
    found: set[int] = set()
    try:
        graph = trace(model, rows)
        for late in (True, False):  # as `cut` places what runs between modules: late, else early
            placed = _place(model, [[row] for row in rows], graph, late=late)
            if len(placed.crossing[-1]) == 1:  # the loss must read one value of the last stage
                found |= {k + 1 for k, values in enumerate(placed.crossing[:-1]) if len(values) == 1}
    except NotImplementedError:
        return []
    return sorted(found)


def _refusal(model: nn.Module, text: str) -> NotImplementedError:
    return NotImplementedError(f"pipeline stages of {type(model).__name__} cannot be cut as planned: {text}; plan "
                               "without pipeline parallelism, or with other stages")


def _place(model: nn.Module, stages: list[list[str]], graph: fx.Graph, *, late: bool) -> _Placed:
    """Every node of ``model``'s forward (``graph``, traced at ``stages``' rows) on its stage, and what crosses each
    boundary; NotImplementedError where no cut could work (inputs, a module reading the labels, what the forward
    returns). What runs between modules runs on the stage of its first reader (``late``), or of its last input
    (an embedding plus a position table the same stage holds: one value handed on, not the two)."""
    stage_of_row = {row: s for s, rows in enumerate(stages) for row in rows}
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    modules = dict(model.named_modules(remove_duplicate=False))
    nodes = list(graph.nodes)
    last = len(stages) - 1

    inputs = [n for n in nodes if n.op == "placeholder" and n.users]
    if len(inputs) != 2:
        raise _refusal(model, f"its forward reads {len(inputs)} input{'s' if len(inputs) != 1 else ''} "
                              f"({', '.join(n.target for n in inputs) or 'none'}); a pipeline's first stage takes "
                              "one and its loss the labels")
    # modules holding parameters or buffers, and parameters: on their row's stage. A module holding neither (a
    # dropout, an activation, a loss module) runs where its call is needed, as a function would, on every stage
    # that calls it (one dropout called after every block)
    pinned: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "call_module" and not _holds_state(modules[n.target]):
            continue
        if n.op in ("call_module", "get_attr"):
            if n.op == "get_attr" and n.target not in params:
                continue  # a buffer or constant: copied where read
            row = _row_of(n.target, stage_of_row)
            if row is None:
                raise _refusal(model, f"module or parameter {n.target!r} belongs to no row of the plan")
            pinned[n] = stage_of_row[row]

    def reaches(sources: set[fx.Node]) -> set[fx.Node]:
        found = set(sources)
        for n in nodes:
            if any(a in found for a in n.all_input_nodes):
                found.add(n)
        return found

    from_pinned = reaches(set(pinned))
    feeding = [p for p in inputs if reaches({p}) & set(pinned)]
    if len(feeding) != 1:
        raise _refusal(model, f"{'both' if feeding else 'neither'} of its inputs "
                              f"({', '.join(p.target for p in inputs)}) feed its layers; a pipeline's first stage "
                              "takes one input and its loss the other")
    source, target = feeding[0], next(p for p in inputs if p is not feeding[0])
    in_loss = reaches({target}) - {target}
    for n in in_loss:
        if n in pinned:
            raise _refusal(model, f"{_what(n)} reads the labels ({target.target}); the labels reach only the loss, "
                                  "which holds no parameters or buffers")
    moving = reaches({source, target}) | from_pinned  # the rest reads buffers and constants alone
    constant = {n for n in nodes if n.op not in ("placeholder", "output") and n not in moving}
    result = next(n for n in nodes if n.op == "output").args[0]
    if not isinstance(result, fx.Node) or result not in in_loss:
        what = "a value that does not read the labels" if isinstance(result, fx.Node) else "more than the loss"
        raise _refusal(model, f"its forward returns {what}; the loss on the last stage is what the forward returns")

    # the stage of every other node: as late as its users allow (items of a module's output: with the module)
    stage: dict[fx.Node, int] = {source: 0}
    for n in in_loss:
        stage[n] = LOSS
    stage.update(pinned)

    def at(n: fx.Node) -> int:  # a user's stage, the loss counting as after the last
        return last + 1 if stage[n] == LOSS else stage[n]

    for n in reversed(nodes):
        if n in stage or n in constant or n.op in ("placeholder", "output"):
            continue
        users = [u for u in n.users if u in stage]  # an assert is placed after, by its inputs
        if late and users and not _projection(n):
            earliest = min(at(u) for u in users)
            stage[n] = LOSS if earliest == last + 1 else earliest
    for n in nodes:  # items of a module's output, and what no one reads (asserts): where their inputs are
        if n in stage or n in constant or n.op in ("placeholder", "output"):
            continue
        stage[n] = max((at(a) for a in n.all_input_nodes if a in stage), default=0)
        if stage[n] == last + 1:
            stage[n] = LOSS
    # what crosses each boundary: a value from its stage up to the stage of its last reader
    crossing: list[list[fx.Node]] = [[] for _ in range(last + 1)]
    for n in nodes:
        if n in stage and n is not target:
            readers = [at(u) for u in n.users if u in stage]
            for boundary in range(at(n), max(readers, default=0)):
                crossing[boundary].append(n)
    return _Placed(nodes=nodes, stage=stage, crossing=crossing, constant=constant, source=source, target=target,
                   result=result)


def _holds_state(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters or buffers (which one stage holds), or nothing (which any may call)."""
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _projection(n: fx.Node) -> bool:
    """An item of a module's output (a layer returning a tuple): kept with the module, so that the next stage is
    handed the item rather than the tuple. Everything else runs as late as its users allow (a shape read for the
    loss's reshape runs in the loss)."""
    return n.op == "call_function" and n.target is operator.getitem and n.args[0].op == "call_module"


def _what(n: fx.Node) -> str:
    if n.op in ("call_module", "get_attr"):
        return f"{'module' if n.op == 'call_module' else 'attribute'} {n.target!r}"
    if n.op == "placeholder":
        return f"input {n.target!r}"
    op = f"Tensor.{n.target}" if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
    base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if base is None:
        of = ""
    elif base.op in ("call_module", "get_attr", "placeholder"):
        of = f" of {'the output of ' if base.op == 'call_module' else ''}{_what(base)}"
    else:
        of = f" of value {base.name!r}"
    return f"value {n.name!r} ({op}{of} in the forward)"


def _graph(handed: list[fx.Node], members: list[fx.Node], out: fx.Node,
           constant: set[fx.Node]) -> tuple[fx.Graph, list[str]]:
    """A graph taking ``handed`` (placeholders, in order), running ``members`` in order (constants they read copied
    in before them) and returning ``out``; and the module and attribute names it reads."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    reads: list[str] = []
    for n in handed:
        env[n] = graph.placeholder(n.name)

    def copy(n: fx.Node) -> fx.Node:
        if n not in env:
            for a in n.all_input_nodes:
                if a in constant:
                    copy(a)
            env[n] = graph.node_copy(n, lambda a: env[a])
            if n.op in ("call_module", "get_attr") and n.target not in reads:
                reads.append(n.target)
        return env[n]

    for n in members:
        copy(n)
    graph.output(env[out] if out in env else copy(out))
    graph.lint()
    return graph, reads


def attach(holder: nn.Module, model: nn.Module, names: Iterable[str]) -> None:
    """Hold each of ``names`` (modules, parameters and buffers of ``model``) in ``holder`` under the same dotted
    name, inside plain containers standing for the modules above it: parameter names stay the whole model's."""
    for dotted in names:
        *above, leaf = dotted.split(".")
        source, place = model, holder
        for part in above:
            source = getattr(source, part)
            if part not in place._modules:
                place.add_module(part, nn.Module())
            place = place._modules[part]
        value = getattr(source, leaf)
        if isinstance(value, nn.Module):
            if leaf not in place._modules:
                place.add_module(leaf, value)
        elif isinstance(value, nn.Parameter):
            place.register_parameter(leaf, value)
        elif isinstance(value, torch.Tensor):
            place.register_buffer(leaf, value, persistent=leaf not in source._non_persistent_buffers_set)
        else:
            setattr(place, leaf, value)


class ChainStage(nn.Module):
    """One pipeline stage of a model of one's own (`cut`): the modules and parameters its graph reads, under their
    names in the whole model, and the graph, which replays that share of the traced forward."""

    kind = "fx"

    def __init__(self, model: nn.Module, layers: list[list[str]], index: int, *, found: Cut | None = None) -> None:
        """``found``: ``model`` already cut at ``layers`` (`cut`), shared by the stages one rank builds."""
        super().__init__()
        found = cut(model, layers) if found is None else found
        self.first, self.last = index == 0, index == len(layers) - 1
        self.shards = 1
        attach(self, model, found.reads[index])
        self._graph = found.graphs[index]
        self.inputs, self.target = found.first, found.target
        # the repeated layers it holds, FSDP units of their own as the cost model prices them
        from autopar.runtime.apply import repeated_layers

        repeated = {id(m) for m in repeated_layers(model)}
        held = [getattr(self.get_submodule(name.rpartition(".")[0]) if "." in name else self, name.rpartition(".")[2])
                for name in found.reads[index]]
        self.units = [m for m in held if id(m) in repeated]
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if self.last:
            holder = nn.Module()
            attach(holder, model, found.loss_reads)
            self.loss_fn = _Loss(holder, found.loss)

    def forward(self, x: Any) -> Any:
        out = fx.Interpreter(self, graph=self._graph).run(x)
        # handed to the next stage: a send takes a contiguous tensor (a transpose between modules makes a view)
        return out.contiguous() if isinstance(out, torch.Tensor) and not self.last else out


class _Loss:
    """The traced forward's loss (what it computes from the last stage's value and the labels), as a pipeline
    schedule's loss function. Holds no parameters: only parameterless modules (a loss module) and buffers."""

    def __init__(self, holder: nn.Module, graph: fx.Graph) -> None:
        self.holder, self.graph = holder, graph

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fx.Interpreter(self.holder, graph=self.graph).run(output, target)


def can_cut(model: nn.Module, rows: list[str]) -> bool:
    """Whether ``model``'s forward can be cut into stages somewhere between its ``rows`` (`cut_points`)."""
    return bool(cut_points(model, rows))
