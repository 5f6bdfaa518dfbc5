"""Expert parallelism: each mixture's experts split over the data-parallel ranks, every token-expert pair sent to the
rank holding its expert and the result sent back, as the cost model prices it (`PipelineModel.expert_parallel`).

A plan with ``ep`` > 1 places its experts' parameters ``S(0)`` on dp (one matrix per expert along dim 0). Each rank
then holds ``experts / ep`` of them as DTensor shards, runs the router on its own tokens (routers stay whole, their
gradients averaged over dp with the rest), and per forward of a mixture:

1. sorts its token-expert pairs by expert, and exchanges with every rank how many pairs it sends to each of that
   rank's experts (an all-to-all of one count per expert);
2. sends each pair's hidden state to the rank holding its expert (an all-to-all);
3. runs the experts' own code (Hugging Face's `transformers.integrations.moe` experts, whichever kernel they
   use) on what it received, on its local experts;
4. sends every result back (an all-to-all), where the routing weights scale it and each token's pairs are summed
   in the order one process sums them.

The backward sends the gradients the same two ways. Each rank's expert gradients cover every rank's tokens, each
rank's share scaled by that rank's own loss, so they are divided by dp after the backward (`ParallelModel`) and
never all-reduced: the one rank holding an expert holds its whole gradient. Under ZeRO 1-3 FSDP shards the rest of
the model and leaves the experts alone (`ignored_params`): they are split over dp already.

Routing decides how many pairs each rank receives, so the all-to-alls' sizes vary from rank to rank; on fake
tensors (a rehearsal) no routing is known and the pairs are taken as spread evenly, as the cost model prices them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def expert_parallel_modules(module: nn.Module, plan: Any) -> list[str]:  # noqa: ANN401 - a Plan
    """The modules of ``module`` whose parameters the plan splits by expert over dp (``ep`` > 1: every parameter
    ``S(0)`` on mesh axis 0), each checked to be experts the runtime can split so. Under ZeRO 3 every parameter is
    ``S(0)`` on dp, FSDP's slices being dim-0 slices too: there the experts are the modules that are experts (as
    `check_experts` knows them), as the cost model finds them in the traced graph; a plan whose estimate took
    other modules for experts issues other collectives than it priced, and is refused when planned."""
    if plan.ep == 1:
        return []
    modules = dict(module.named_modules())
    found = []
    for entry in plan.modules:
        split = [p for p in entry.params if p.placements[0].is_shard(0)]
        if not split or (plan.zero == 3 and not _are_experts(modules.get(entry.fqn))):
            continue
        if len(split) != len(entry.params):
            raise ValueError(f"the plan splits some parameters of module {entry.fqn!r} by expert over dp and not "
                             "others: a module's experts split together")
        if entry.fqn in modules:
            check_experts(modules[entry.fqn], entry.fqn, plan.ep)
            found.append(entry.fqn)
    if not found:
        raise ValueError(f"the plan splits experts over {plan.ep} ranks (ep) but no module's parameters by expert "
                         "(S(0) on dp): it has no experts to split")
    return found


def _are_experts(module: nn.Module | None) -> bool:
    """Hugging Face's experts, as `transformers.integrations.moe.use_experts_implementation` marks them: a
    ``num_experts`` count, an ``is_transposed`` flag and parameters of their own."""
    return (module is not None and isinstance(getattr(module, "num_experts", None), int)
            and hasattr(module, "is_transposed") and any(True for _ in module.parameters(recurse=False)))


def check_experts(experts: nn.Module, fqn: str, ep: int) -> None:
    """Refuse, naming ``fqn``, experts expert parallelism cannot split: not Hugging Face's experts (a
    ``num_experts`` count and parameters holding one entry per expert along dim 0), or a count ``ep`` does not
    divide."""
    count = experts.num_experts if _are_experts(experts) else None
    params = dict(experts.named_parameters(recurse=False))
    kind = type(experts).__name__
    if count is None:
        reason = "only Hugging Face experts (one weight per expert along dim 0, run with the tokens' chosen experts) " \
                 "can be split by expert"
    elif any(p.dim() < 2 or p.shape[0] != count for p in params.values()):
        reason = f"its parameters do not hold one entry per expert along dim 0 ({count} experts)"
    elif count % ep:
        reason = f"its {count} experts do not split over ep {ep}"
    else:
        return
    raise NotImplementedError(f"module {fqn!r} ({kind}) cannot be split by expert parallelism: {reason}")


def split_by_expert(experts: nn.Module, mesh: Any) -> list[nn.Parameter]:  # noqa: ANN401 - a 1-D DeviceMesh
    """Hold ``experts``' parameters as shards by expert over the 1-D ``mesh`` (the data-parallel ranks) and run
    its forward as the module docstring says; returns the new parameters (their gradients to be divided by the
    mesh's size after the backward)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from autopar.runtime.apply import _LocalExperts

    ranks = mesh.size()
    total = experts.num_experts
    local = total // ranks
    params = []
    for name, param in list(experts.named_parameters(recurse=False)):
        new = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        experts.register_parameter(name, new)
        params.append(new)
    experts.num_experts = local  # the experts' own code counts the experts this rank holds
    forward = experts.forward
    group = mesh.get_group()

    @functools.wraps(forward)
    def by_expert(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, width = hidden_states.shape
        top_k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # pairs by expert, so by the rank holding it
        sent = hidden_states[order // top_k]
        counts = _sent_counts(chosen, total)
        received = _exchange_counts(counts, ranks, group, chosen.device, fake=_is_fake(chosen))  # ranks x experts
        send_sizes = [sum(sizes) for sizes in _per_rank(counts, ranks)]
        receive_sizes = [sum(sizes) for sizes in _per_rank(received, ranks)]
        arrived = _all_to_all(sent, receive_sizes, send_sizes, group)
        experts_of = torch.arange(local, device=arrived.device).repeat(ranks)
        ids = torch.repeat_interleave(experts_of, torch.tensor(received, device=arrived.device),
                                      output_size=arrived.shape[0])
        roles = {id(getattr(experts, name)): "expert" for name, _ in experts.named_parameters(recurse=False)}
        ones = torch.ones(arrived.shape[0], 1, dtype=top_k_weights.dtype, device=arrived.device)
        with _LocalExperts(roles, group):
            done = forward(arrived, ids[:, None], ones)
        back = _all_to_all(done, send_sizes, receive_sizes, group)
        pairs = back.new_zeros(back.shape).index_copy(0, order, back)  # each pair back in its token's place
        weighted = pairs * top_k_weights.reshape(-1, 1)
        return weighted.view(tokens, top_k, width).sum(dim=1).to(hidden_states.dtype)

    experts.forward = by_expert
    return params


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or tensor.device.type == "meta"


def _sent_counts(chosen: torch.Tensor, total: int) -> list[int]:
    """Pairs this rank sends to each expert; on fake tensors (a rehearsal, where no routing is known) the pairs
    spread evenly over the experts."""
    if _is_fake(chosen):
        return [chosen.numel() // total + (e < chosen.numel() % total) for e in range(total)]
    return torch.bincount(chosen, minlength=total).tolist()


def _per_rank(counts: list[int], ranks: int) -> list[list[int]]:
    local = len(counts) // ranks
    return [counts[r * local:(r + 1) * local] for r in range(ranks)]


def _exchange_counts(counts: list[int], ranks: int, group: Any, device: Any, *,  # noqa: ANN401
                     fake: bool) -> list[int]:
    """Pairs each rank sends to each of this rank's experts (rank after rank, expert after expert), by an
    all-to-all of ``counts`` (this rank's pairs per expert); with ``fake`` (a rehearsal), every rank taken as
    sending what this one does."""
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_to_all_single(torch.tensor(counts, dtype=torch.int64, device=device), None, None, group)
    out = funcol.wait_tensor(out)
    return _per_rank(counts, ranks)[0] * ranks if fake else out.tolist()


def _all_to_all(tensor: torch.Tensor, output_sizes: list[int], input_sizes: list[int],
                group: Any) -> torch.Tensor:  # noqa: ANN401 - a process group
    """Rows of ``tensor`` sent to the ranks of ``group`` (``input_sizes`` to each) and theirs received
    (``output_sizes`` from each), with gradients sent back the other way."""
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(tensor.contiguous(), output_sizes, input_sizes, group)
    return funcol.wait_tensor(out)
