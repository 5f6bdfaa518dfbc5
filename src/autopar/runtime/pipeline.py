"""Pipeline parallelism: cut a model into the plan's stages and run them with ``torch.distributed.pipelining``.

Every rank builds the whole model from one seed, keeps its stage's modules in a `StageModule` (same parameter
names as the whole model, so the plan's layouts still apply) and drops the rest. Ranks form a (pp, dp, tp) mesh,
tp innermost: stage ``s`` is ranks ``s*dp*tp ...``. Inside a stage, tensor parallelism and data parallelism
(DDP) apply as for a single stage; `PipelineStage` and the plan's schedule (``ScheduleGPipe`` or
``Schedule1F1B``) move activations forward and gradients back over the pp axis.

A weight tied across stages (GPT's head reads the embedding) is held by the first and the last stage; after the
backward their gradients are summed over the pair of ranks, as Megatron-LM does, and the cost model prices that
all-reduce on the pp axis.

The chain of a model is what its ``forward`` runs: the zoo's GPT-style and LLaMA-style language models, Hugging
Face's LLaMA-style causal LMs (also under Phi's and GPT-NeoX's names), its GPT-2-style ones (``transformer`` holding
``wte``, ``wpe``, ``drop``, ``h`` and ``ln_f``) and its OPT-style ones (``model.decoder``: learned positions,
optional projections in and out) are supported (embedding, the repeated layers, final norm and head; the last
stage returns logits and the schedule's loss function computes the loss). A Hugging Face model's stages are
checked against its own forward on a small copy before a plan is offered (`check_stage_forward`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.plan import Plan
from autopar.zoo.layers import lm_loss


@dataclass(frozen=True)
class Chain:
    """Where a Hugging Face causal LM keeps its chain: the module under ``outer`` holds the repeated layers as
    ``stack``, the modules ``first`` of them (on the first stage), those after them (``last``, on the last stage)
    and ``every`` stage's own (rotary tables); ``lm_head`` is the model's."""

    outer: str
    stack: str  # a dotted path under ``outer`` (BERT's ``encoder.layer``)
    first: tuple[str, ...]
    last: tuple[str, ...]
    every: tuple[str, ...] = ()
    head: str = "lm_head"  # the model's head (BERT's ``cls``)
    shifted: bool = True  # the loss: position t predicts label t + 1 (a causal LM), or label t (masked LM)
    inputs: str = "input_ids"  # what the first stage takes (an image model's ``pixel_values``)

    @property
    def modules(self) -> tuple[str, ...]:
        return (self.stack, *self.first, *self.last, *self.every)

    def inner(self, model: nn.Module) -> Any:
        """The module under ``outer`` (a dotted path: OPT keeps its chain in ``model.decoder``), or None."""
        return _path(model, self.outer)

    def layers(self, model: nn.Module) -> Any:
        """The list of layers under ``outer`` of ``model`` (the whole model or a stage), or None."""
        return _path(self.inner(model), self.stack)


def _path(module: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


def _has(module: Any, dotted: str) -> bool:
    """Whether ``module`` has the attribute at the dotted path (one set to None counts: OPT's absent projections)."""
    above, _, name = dotted.rpartition(".")
    return hasattr(_path(module, above) if above else module, name)


def _boxed(dotted: str, module: nn.Module) -> tuple[str, nn.Module]:
    """(the first name of ``dotted``, what holds ``module`` under the rest of it): plain containers standing for
    the modules above it, so that its parameters keep their names in the whole model."""
    holder, *above = dotted.split(".")[::-1]
    for part in above:
        module, below = nn.Module(), module
        setattr(module, holder, below)
        holder = part
    return holder, module


# the Hugging Face chains: stages are checked on a small copy (`check_stage_forward`), the loss shifted by one token.
# A LLaMA-style chain's ``first`` is its embedding and what runs on its output before the layers, ``last`` its
# final norm, ``every`` its rotary embedding.
HF_CHAINS = {
    "hf": Chain("model", "layers", first=("embed_tokens",), last=("norm",), every=("rotary_emb",)),  # LLaMA-style
    # LLaMA-style under other names, a dropout after the embedding
    "phi": Chain("model", "layers", first=("embed_tokens", "embed_dropout"), last=("final_layernorm",),
                 every=("rotary_emb",)),
    "gpt_neox": Chain("gpt_neox", "layers", first=("embed_in", "emb_dropout"), last=("final_layer_norm",),
                      every=("rotary_emb",)),
    "persimmon": Chain("model", "layers", first=("embed_tokens",), last=("final_layernorm",), every=("rotary_emb",)),
    # GPT-J and CodeGen: LLaMA-style under GPT-2's names, no learned positions
    "gptj": Chain("transformer", "h", first=("wte", "drop"), last=("ln_f",), every=("rotary_emb",)),
    "gpt2": Chain("transformer", "h", first=("wte", "wpe", "drop"), last=("ln_f",)),  # GPT-2-style
    # OPT-style: learned positions (offset by 2) added to the embedding, optional projections in and out
    "opt": Chain("model.decoder", "layers", first=("embed_tokens", "project_in", "embed_positions"),
                 last=("final_layer_norm", "project_out")),
    # Falcon: LLaMA-style under GPT-2's names (its layers also take an ALiBi bias, None where the config has rotary
    # positions: a Falcon with ALiBi fails `check_stage_forward`, its bias being left out)
    "falcon": Chain("transformer", "h", first=("word_embeddings",), last=("ln_f",), every=("rotary_emb",)),
    # BLOOM: a norm after the embedding, ALiBi biases made from the whole sequence's length for every stage
    "bloom": Chain("transformer", "h", first=("word_embeddings", "word_embeddings_layernorm"), last=("ln_f",)),
    # MPT: ALiBi biases made from the config's longest sequence for every stage, no positions in the embedding
    "mpt": Chain("transformer", "blocks", first=("wte",), last=("norm_f",)),
    # XGLM and BioGPT: scaled token embeddings plus positions (sinusoidal; learned, offset by 2), OPT-style
    "xglm": Chain("model", "layers", first=("embed_tokens", "embed_positions"), last=("layer_norm",)),
    "biogpt": Chain("biogpt", "layers", first=("embed_tokens", "embed_positions"), last=("layer_norm",),
                    head="output_projection"),
    # CTRL: the token embedding scaled, plus the sinusoidal table the model keeps as a buffer (made from the config)
    "ctrl": Chain("transformer", "h", first=("w", "dropout"), last=("layernorm",)),
    # RecurrentGemma: recurrent and local-attention blocks called positionally, the embedding scaled by a buffer
    "recurrent_gemma": Chain("model", "layers", first=("embed_tokens",), last=("final_norm",)),
    # masked LMs: post-norm encoders, no mask (every position sees every other), the loss unshifted
    "roberta": Chain("roberta", "encoder.layer", first=("embeddings",), last=(), shifted=False),
    "bert": Chain("bert", "encoder.layer", first=("embeddings",), last=(), head="cls", shifted=False),
    # ViT classifying images: patches and the class token embedded, the layers, a norm, the head on the class token
    "vit": Chain("vit", "layers", first=("embeddings",), last=("layernorm",), head="classifier",
                 shifted=False, inputs="pixel_values"),
}
ENCODERS = ("roberta", "bert", "vit")  # the chains `StageModule._forward_encoder` runs


class StageModule(nn.Module):
    """The modules of one pipeline stage of a language model, under their names in the whole model.

    Knows the zoo's GPT-style and LLaMA-style models and the Hugging Face chains of `HF_CHAINS`: LLaMA-style causal
    LMs (``model.model`` holding ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``, and ``lm_head``; Phi's,
    GPT-NeoX's, Persimmon's and GPT-J's (CodeGen's) the same under other names), GPT-2-style ones
    (``model.transformer`` holding ``wte``, ``wpe``, ``drop``, ``h`` and ``ln_f``, and ``lm_head``), OPT-style ones
    (``model.model.decoder``) and XGLM and BioGPT (OPT-style with positions of their own), Falcon, BLOOM and MPT,
    and RoBERTa and BERT masked LMs (``roberta.encoder.layer``, the head ``lm_head`` or ``cls``)."""

    def __init__(self, model: nn.Module, layers: list[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.kind = chain_kind(model)
        self.first, self.last = first, last
        # under sequence parallelism, the shards of the sequence a stage after the first is handed (its tp size):
        # positions, masks and rotary tables are made for the whole sequence, which attention gathers
        self.shards = 1
        stack = _layers(model)
        chosen = nn.ModuleDict({str(i): stack[i] for i in layers})
        if getattr(stack, "_autopar_spans", None):  # the plan's checkpointed runs, those inside this stage
            from autopar.runtime.apply import segment_layers

            segment_layers(chosen, stack._autopar_spans)
        if self.kind in HF_CHAINS:
            chain = HF_CHAINS[self.kind]
            whole = chain.inner(model)
            inner = nn.Module()  # the outer module's name kept, so parameter names match the whole model's
            held = dict([_boxed(chain.stack, chosen)]) | {
                name: getattr(whole, name) for name in
                chain.every + (chain.first if first else ()) + (chain.last if last else ())}
            # in the whole model's order (sequence parallelism tells a norm before the layers from one after them
            # by it), then those the model sets to None (OPT's absent projections)
            for name in [*(n for n in whole._modules if n in held), *(n for n in held if n not in whole._modules)]:
                setattr(inner, name, held[name])
            setattr(self, *_boxed(chain.outer, inner))
            self.config = model.config  # not a module: its masks are made per forward from it
            scale = getattr(model, "logit_scale", None)  # a number (Cohere), not a parameter
            self.logit_scale = scale if isinstance(scale, (int, float)) else None
            if last:
                setattr(self, chain.head, getattr(model, chain.head))
            return
        if first:
            self.embed = model.embed
            if self.kind == "gpt":
                self.pos, self.drop = model.pos, model.drop
        if self.kind == "llama":
            self.rotary = model.rotary
        self.layers = chosen
        if last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward(x)
        # handed to the next stage: a send takes a contiguous tensor
        return out if self.last else out.contiguous()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind in LLAMA_STYLE:
            return self._forward_hf(x)
        if self.kind == "gpt2":
            return self._forward_gpt2(x)
        if self.kind == "opt":
            return self._forward_opt(x)
        if self.kind == "bloom":
            return self._forward_bloom(x)
        if self.kind == "mpt":
            return self._forward_mpt(x)
        if self.kind in ("xglm", "biogpt"):
            return self._forward_positions(x)
        if self.kind == "ctrl":
            return self._forward_ctrl(x)
        if self.kind == "recurrent_gemma":
            return self._forward_recurrent_gemma(x)
        if self.kind in ENCODERS:
            return self._forward_encoder(x)
        if self.first:
            ids = x
            x = self.embed(ids)
            if self.kind == "gpt":
                x = self.drop(x + self.pos.weight[: ids.shape[1]])
        extra = self.rotary(self._length(x)) if self.kind == "llama" else ()
        for layer in self.layers.values():
            x = layer(x, *extra)
        if self.last:
            return self.head(self.norm(x))
        return x

    def _forward_hf(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's share of a Hugging Face decoder's forward: each layer gets the mask and position embeddings
        of its attention type (``config.layer_types``: full or sliding-window attention; a model without them has
        one type, sliding where its config sets a window), built as the whole model builds them."""
        chain, config = HF_CHAINS[self.kind], self.config
        inner = chain.inner(self)
        if self.first:
            x = getattr(inner, chain.first[0])(x)
            multiplier = getattr(config, "embedding_multiplier", None)  # Granite scales its embeddings
            if multiplier is not None:
                x = x * multiplier
            for name in chain.first[1:]:  # a dropout
                x = getattr(inner, name)(x)
        positions = torch.arange(self._length(x), device=x.device).unsqueeze(0)
        whole = self._whole(x)
        types = getattr(config, "layer_types", None)
        masks: dict[str, Any] = {}
        rotary: dict[str, Any] = {}
        rotary_emb = getattr(inner, chain.every[0])
        for key, layer in getattr(inner, chain.stack).items():
            kind = types[int(key)] if types else _one_attention_type(config)
            if kind not in masks:
                masks[kind] = _attention_mask(config, kind, whole, positions)
                rotary[kind] = (rotary_emb(whole, positions, kind) if _rotary_by_type(rotary_emb)
                                else rotary_emb(whole, position_ids=positions))
            alibi = {"alibi": None} if _takes_alibi(layer) else {}
            x = _hidden(layer(x, attention_mask=masks[kind], position_embeddings=rotary[kind], position_ids=positions,
                              **alibi))
        if self.last:
            return self._logits(self.lm_head(getattr(inner, chain.last[0])(x)))
        return x

    def _forward_encoder(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's share of an encoder's forward: the embeddings (a masked LM's positions, token types and
        their norm, made from the ids; ViT's patches, class token and positions, made from the pixels), the layers
        with no mask, as the model runs them without padding, and the head (ViT's after its norm, on the class
        token)."""
        chain = HF_CHAINS[self.kind]
        inner = chain.inner(self)
        if self.first:
            x = inner.embeddings(**{chain.inputs: x})
        for layer in chain.layers(self).values():
            x = _hidden(layer(x) if self.kind == "vit" else layer(x, attention_mask=None))
        if not self.last:
            return x
        if self.kind == "vit":
            return self.classifier(inner.layernorm(x)[:, 0])
        return getattr(self, chain.head)(x)

    def _forward_bloom(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's share of a BLOOM forward: the embedding and its norm, the layers under the causal mask with
        the ALiBi biases of every head over the whole sequence (as the model makes them without padding), the
        final norm and the head."""
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        inner = self.transformer
        length = self._length(x)
        if self.first:
            x = inner.word_embeddings_layernorm(inner.word_embeddings(x))
        positions = torch.arange(length, device=x.device).unsqueeze(0)
        every = torch.ones(x.shape[0], length, device=x.device, dtype=torch.long)
        alibi = build_alibi_tensor(every, self.config.n_head, dtype=x.dtype)
        mask = _attention_mask(self.config, "full_attention", self._whole(x), positions)
        for layer in inner.h.values():
            x = _hidden(layer(x, alibi=alibi, attention_mask=mask))
        if self.last:
            return self._logits(self.lm_head(inner.ln_f(x)))
        return x

    def _forward_mpt(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's share of an MPT forward: the embedding, the layers under the causal mask (boolean, as the
        model makes it) with the ALiBi biases of every head over the config's longest sequence (as the model makes
        them, whatever the input's length), the final norm and the head."""
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        inner = self.transformer
        if self.first:
            x = inner.wte(x)
        positions = torch.arange(self._length(x), device=x.device).unsqueeze(0)
        alibi = build_mpt_alibi_tensor(self.config.n_heads, self.config.max_seq_len, device=x.device)
        mask = _attention_mask(self.config, "full_attention", self._whole(x), positions)
        mask = mask.to(torch.bool) if mask is not None else None
        for layer in inner.blocks.values():
            x = _hidden(layer(x, attention_mask=mask, position_bias=alibi))
        if self.last:
            return self._logits(self.lm_head(inner.norm_f(x)))
        return x

    def _forward_positions(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's share of an XGLM or BioGPT forward: the scaled token embedding plus the positions (XGLM's
        sinusoidal table, BioGPT's learned one, made from the model's unpadded mask), dropped out at the config's
        rate, the layers under the causal mask (BioGPT's given the positions too), the final norm and the head."""
        chain, config = HF_CHAINS[self.kind], self.config
        inner = chain.inner(self)
        length = self._length(x)
        positions = torch.arange(length, device=x.device).unsqueeze(0)
        if self.first:
            ids = x
            x = inner.embed_tokens(ids)
            if self.kind == "xglm":
                x = x + inner.embed_positions(positions, 0).to(x.device)
            else:
                every = torch.ones(ids.shape[0], length, device=ids.device)
                x = x + inner.embed_positions(every, 0, position_ids=positions)
            rate = config.dropout if self.kind == "xglm" else config.hidden_dropout_prob
            x = nn.functional.dropout(x, p=float(rate), training=self.training)
        mask = _attention_mask(config, "full_attention", self._whole(x), positions)
        extra = {"position_ids": positions} if self.kind == "biogpt" else {}
        for layer in chain.layers(self).values():
            x = _hidden(layer(x, attention_mask=mask, **extra))
        if self.last:
            return self._logits(getattr(self, chain.head)(inner.layer_norm(x)))
        return x

    def _forward_ctrl(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's share of a CTRL forward: the token embedding scaled by the square root of its width plus
        the sinusoidal positions (the table the model makes from its config and keeps as a buffer), dropped out,
        the layers under the causal mask, the final norm and the head tied to the embedding."""
        from transformers.models.ctrl.modeling_ctrl import positional_encoding

        inner, config = self.transformer, self.config
        positions = torch.arange(self._length(x), device=x.device).unsqueeze(0)
        if self.first:
            table = positional_encoding(config.n_positions, config.n_embd, torch.float).to(x.device)
            x = inner.w(x) * float(config.n_embd) ** 0.5
            x = inner.dropout(x + table.to(x.dtype)[positions])
        mask = _attention_mask(config, "full_attention", self._whole(x), positions)
        for layer in inner.h.values():
            x = _hidden(layer(x, attention_mask=mask))
        if self.last:
            return self._logits(self.lm_head(inner.layernorm(x)))
        return x

    def _forward_recurrent_gemma(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's share of a RecurrentGemma forward: the embedding scaled by the model's normalizer (the square
        root of its width, a bf16 buffer the model makes from its config), the layers (recurrent or local attention)
        given the positions and the sliding-window mask positionally, as the model calls them, the final norm, and
        the head's logits soft-capped."""
        inner, config = self.model, self.config
        positions = torch.arange(self._length(x), device=x.device).unsqueeze(0)
        if self.first:
            x = inner.embed_tokens(x)
            x = x * torch.tensor(config.hidden_size**0.5, dtype=torch.bfloat16).to(x.device, x.dtype)
        mask = _attention_mask(config, "sliding_attention", self._whole(x), positions)
        for layer in inner.layers.values():
            x = _hidden(layer(x, positions, mask, False, None))
        if not self.last:
            return x
        cap = config.logits_soft_cap
        return torch.tanh(self._logits(self.lm_head(inner.final_norm(x))) / cap) * cap

    def _forward_gpt2(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's share of a GPT-2-style forward: token and position embeddings summed and dropped out, the
        layers under the causal mask the whole model builds, the final norm and the head."""
        inner = self.transformer
        positions = torch.arange(self._length(x), device=x.device).unsqueeze(0)
        if self.first:
            x = inner.drop(inner.wte(x) + inner.wpe(positions))
        mask = _attention_mask(self.config, "full_attention", self._whole(x), positions)
        for layer in inner.h.values():  # (GPT-Neo's layers return a tuple)
            x = _hidden(layer(x, attention_mask=mask, position_ids=positions))
        if self.last:
            return self._logits(self.lm_head(inner.ln_f(x)))
        return x

    def _forward_opt(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's share of an OPT-style decoder's forward: the token embedding (projected in where the model
        has a projection) plus the learned positions, the layers under the causal mask, the final norm and the
        projection out where the model has them, and the head."""
        inner = HF_CHAINS["opt"].inner(self)
        length = self._length(x)
        positions = torch.arange(length, device=x.device).unsqueeze(0)
        if self.first:
            ids = x
            x = inner.embed_tokens(ids)
            if inner.project_in is not None:
                x = inner.project_in(x)
            every = torch.ones(ids.shape[0], length, device=ids.device)  # as the model's unpadded positions
            x = x + inner.embed_positions(every, 0, position_ids=positions)
        mask = _attention_mask(self.config, "full_attention", self._whole(x), positions)
        for layer in inner.layers.values():
            x = layer(x, attention_mask=mask, position_ids=positions)
        if self.last:
            if inner.final_layer_norm is not None:
                x = inner.final_layer_norm(x)
            if inner.project_out is not None:
                x = inner.project_out(x)
            return self._logits(self.lm_head(x))
        return x

    def _length(self, x: torch.Tensor) -> int:
        """The whole sequence's length, where the stage's input ``x`` (token ids on the first stage, the stream
        after it) may hold one shard of it (`shards`)."""
        return x.shape[1] * (1 if self.first else self.shards)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as long as the whole sequence, for what reads only its shape, dtype and device (a mask maker, a
        rotary table): a view repeating its first position, no copy, where ``x`` is one shard."""
        length = self._length(x)
        return x if x.shape[1] == length else x[:, :1].expand(x.shape[0], length, *x.shape[2:])

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output as the causal LM's forward ends it: scaled (Cohere's ``logit_scale``, Granite's
        ``logits_scaling``) or soft-capped (Gemma 2's ``final_logit_softcapping``)."""
        config = self.config
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        scaling = getattr(config, "logits_scaling", None)
        if scaling is not None:
            logits = logits / scaling
        cap = getattr(config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


LLAMA_STYLE = ("hf", "phi", "gpt_neox", "persimmon", "gptj", "falcon")  # the chains `StageModule._forward_hf` runs


def _takes_alibi(layer: nn.Module) -> bool:
    """Whether a layer's forward takes an ALiBi bias (Falcon's, which may be None)."""
    import inspect

    return "alibi" in inspect.signature(layer.forward).parameters


def _hidden(out: Any) -> torch.Tensor:
    """A layer's output stream: the first of a tuple (Falcon's and BLOOM's layers return one), or the tensor."""
    return out[0] if isinstance(out, tuple) else out


def _one_attention_type(config: Any) -> str:
    """The attention type of every layer of a model whose config lists none: sliding-window attention where the
    config sets a window (Mistral, Phi-3), else full."""
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _attention_mask(config: Any, kind: str, x: torch.Tensor, positions: torch.Tensor) -> Any:
    """The mask the whole model gives layers of attention type ``kind`` (None where SDPA runs causal by itself)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    if kind not in makers:
        raise NotImplementedError(f"pipeline stages cannot run layers of attention type {kind!r} yet (full and "
                                  "sliding-window attention can)")
    maker = makers[kind]
    return maker(config=config, inputs_embeds=x, attention_mask=None, position_ids=positions,
                 **{_cache_parameter(maker): None})


@functools.cache
def _cache_parameter(maker: Any) -> str:
    """The name a mask maker takes the (absent) KV cache by: ``cache`` in transformers 5.2x, where
    ``past_key_values`` is deprecated with a warning, ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(maker).parameters else "past_key_values"


def _rotary_by_type(rotary: nn.Module) -> bool:
    """Whether the model's rotary embedding takes the layer's attention type (Gemma 3: one base per type)."""
    import inspect

    return "layer_type" in inspect.signature(rotary.forward).parameters


def chain_kind(model: nn.Module) -> str:
    """Which chain ``model`` is: the zoo's ``gpt`` or ``llama``, a Hugging Face family of `HF_CHAINS`, or ``fx``: any
    other model, cut by its own traced forward (`autopar.runtime.chain`), where it can be."""
    from autopar.zoo.gpt import GPT
    from autopar.zoo.llama import Llama

    if isinstance(model, GPT):
        return "gpt"
    if isinstance(model, Llama):
        return "llama"
    for kind, chain in HF_CHAINS.items():
        inner = chain.inner(model)
        if hasattr(model, chain.head) and inner is not None and all(_has(inner, a) for a in chain.modules):
            return kind
    return "fx"


CHECK_SEQ = 16  # tokens of the small copy's check; a sliding window shorter than the real sequence is made 8


def check_stage_forward(model: nn.Module, *, seq: int) -> None:
    """Refuse (NotImplementedError, naming the class) pipeline stages of a Hugging Face model whose forward does
    more than a stage runs (embedding, scaled as Granite's; layers under the masks of their attention types; norm;
    head, its logits scaled or capped as Cohere's, Granite's and Gemma 2's): a mask of another kind, say, or another
    step after the head. Stages would then train a different model.

    Checked on numbers, not on names: a small copy of the model (the same class and config, 4 layers or fewer,
    hidden 64, 4 heads, vocabulary 128, random weights; a sliding window shorter than the real ``seq`` stays
    shorter than the check's tokens, one as long or longer stays so) computes its logits whole and through two
    stages, which must agree."""
    if chain_kind(model) not in HF_CHAINS:
        return
    name = type(model).__name__

    def failed(what: str, exc: Exception) -> NotImplementedError:
        text = str(exc).strip().splitlines()
        return NotImplementedError(f"pipeline stages of {name} {what}: {type(exc).__name__}: "
                                   f"{text[0] if text else ''}; plan without pipeline parallelism")

    try:
        small = _small_copy(model, seq=seq)
        torch.manual_seed(0)
        ids = _check_input(small)
        with torch.no_grad():
            whole = small(**{HF_CHAINS[chain_kind(small)].inputs: ids}).logits
    except Exception as exc:  # noqa: BLE001 - whatever building or running the copy raised: unchecked, refused
        raise failed("cannot be checked against its forward: a small copy of the model failed", exc) from None
    try:
        with torch.no_grad():
            layers = len(_layers(small))
            cut = max(1, layers // 2)
            first = StageModule(small, list(range(cut)), first=True, last=False)
            last = StageModule(small, list(range(cut, layers)), first=False, last=True)
            staged = last(first(ids))
    except Exception as exc:  # noqa: BLE001 - whatever the stages raised: they cannot run this model
        raise failed("fail on a small copy of the model", exc) from None
    difference = float((staged - whole).abs().max())
    if not torch.allclose(staged, whole, rtol=1e-4, atol=1e-5):
        raise NotImplementedError(
            f"pipeline stages of {name} would train a different model: its forward does more than a stage runs "
            "(embedding, layers under the masks of their attention types, norm, head, the logits' scale or cap), "
            "e.g. another kind of mask or another step after the head (a small copy's logits differ by up to "
            f"{difference:.3g}); plan without pipeline parallelism")


def _check_input(model: nn.Module) -> torch.Tensor:
    """Two rows of the input the first stage of ``model`` (a small copy) takes: token ids of `CHECK_SEQ` tokens, or
    images of the size its config gives."""
    config = model.config
    if HF_CHAINS[chain_kind(model)].inputs == "pixel_values":
        return torch.randn(2, config.num_channels, config.image_size, config.image_size)
    return torch.randint(0, config.vocab_size, (2, CHECK_SEQ))


def _small_copy(model: nn.Module, *, seq: int) -> nn.Module:
    """``model``'s class built on CPU in fp32 from its config made small (`check_stage_forward`), in eval mode."""
    import copy

    from autopar.zoo.hf_auto import _per_layer
    from autopar.zoo.hf_fields import field_names, read

    config = copy.deepcopy(model.config)
    layers = len(_layers(model))
    small = min(layers, 4)
    sizes = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128, "vocab": 128, "layers": small}
    if read(config, "kv_heads") in (0, read(config, "heads")):
        sizes["kv_heads"] = 4  # no grouped-query attention (or no field for it: Falcon's MQA flag): keep it so
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):
        del sizes["head_dim"]  # multi-head latent attention (DeepSeek-V3): its head_dim is its rotary width
    for option, value in sizes.items():
        for field in field_names(config, option):
            setattr(config, field, value)
    for key, value in _per_layer(config, layers, small).items() if layers > 1 else ():
        setattr(config, key, value)
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int) and not 0 <= pad < config.vocab_size:
        config.pad_token_id = config.vocab_size - 1  # the embedding's padding row must be one of its rows
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        config.sliding_window = 8 if window < seq else CHECK_SEQ
    torch.manual_seed(0)
    with torch.device("cpu"):
        built = type(model)(config)
    return built.float().eval()


def _layers(model: nn.Module) -> nn.ModuleList:
    chain = HF_CHAINS.get(chain_kind(model))
    return chain.layers(model) if chain else model.layers


def stage_stack(part: StageModule) -> nn.ModuleDict:
    """The repeated layers a stage holds, by their index in the whole model."""
    chain = HF_CHAINS.get(part.kind)
    return chain.layers(part) if chain else part.layers


def shifted_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: position t predicts label t + 1."""
    return lm_loss(logits[:, :-1], labels[:, 1:])


def stage_layers(model: nn.Module, plan: Plan) -> list[list[int]] | list[list[str]]:
    """The repeated-layer indices of each stage. Rows that are not repeated layers (embedding, norm, head) belong to
    the first or the last stage; a plan that puts one elsewhere is refused by name. A model of one's own (``fx``)
    is cut by its traced forward at the plan's rows (`autopar.runtime.chain.cut`, which refuses a cut it cannot
    make): its stages' rows are returned."""
    stages = plan.stages
    if chain_kind(model) == "fx":
        return _own_stages(model, plan)
    chain = HF_CHAINS.get(chain_kind(model))
    prefix = f"{chain.outer}.{chain.stack}" if chain else "layers"
    count = len(_layers(model))
    result = []
    for number, stage in enumerate(stages):
        indices = []
        for name in stage.layers:
            head, _, index = name.rpartition(".")
            if head == prefix and index.isdigit() and int(index) < count:
                indices.append(int(index))
            elif 0 < number < len(stages) - 1:
                raise NotImplementedError(f"stage {number} holds {name!r}; only repeated layers can sit in a middle "
                                          "stage (the embedding goes first, the norm and head last)")
        if not indices:
            raise NotImplementedError(f"stage {number} holds no repeated layer; every stage needs at least one")
        result.append(indices)
    return result


def _own_stages(model: nn.Module, plan: Plan) -> list[list[str]]:
    """The rows of each stage of a pipeline of a model of one's own, checked by cutting its forward there."""
    from autopar.runtime.chain import cut

    name = type(model).__name__
    if plan.sp:
        raise NotImplementedError(f"sequence parallelism in pipeline stages of {name} (cut by its traced forward) "
                                  "cannot be run yet; plan without --sp")
    if any(stage.segments for stage in plan.stages):
        raise NotImplementedError(f"checkpointed runs of layers in pipeline stages of {name} (cut by its traced "
                                  "forward) cannot be run yet; recompute layers one by one")
    layers = [list(stage.layers) for stage in plan.stages]
    cut(model, layers)
    return layers


def make_stage(model: nn.Module, layers: list[list[int]] | list[list[str]], index: int, *,
               found: Any = None) -> nn.Module:
    """Stage ``index`` of ``model`` cut at ``layers`` (`stage_layers`); ``found``: a model of one's own already cut
    there (`own_cut`), so that the stages one rank builds trace its forward once."""
    if chain_kind(model) == "fx":
        from autopar.runtime.chain import ChainStage

        return ChainStage(model, layers, index, found=found)
    return StageModule(model, layers[index], first=index == 0, last=index == len(layers) - 1)


def own_cut(model: nn.Module, layers: list[list[int]] | list[list[str]]) -> Any:
    """A model of one's own cut at ``layers`` (`autopar.runtime.chain.cut`), or None for a known chain."""
    if chain_kind(model) != "fx":
        return None
    from autopar.runtime.chain import cut

    return cut(model, layers)


def stage_units(part: nn.Module) -> list[nn.Module]:
    """The repeated layers a stage holds, each an FSDP unit of its own."""
    if getattr(part, "kind", None) == "fx":
        return list(part.units)
    return list(stage_stack(part)._modules.values())


@dataclass
class Pipeline:
    """This rank's stage and the schedule that drives it."""

    stage: int
    stages: int
    schedule: Any
    tied: list[tuple[nn.Parameter, Any]]  # (parameter, group with its twin on the other end of the pipeline)
    inputs: str = "input_ids"  # the batch's input the first stage takes
    target: str = "labels"  # and the one the loss takes

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def sync_tied(self) -> None:
        """Sum the gradients of weights held by both ends of the pipeline."""
        import torch.distributed as dist

        for param, group in self.tied:
            if param.grad is not None:  # FSDP: each rank's shard, the same rows on both ends
                grad = param.grad
                dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)


def build(
    model: nn.Module, plan: Plan, mesh: Any, *, wrap: Callable[[nn.Module], nn.Module], micro_batches: int,
    example: torch.Tensor | None = None,
) -> tuple[list[nn.Module], list[dict[str, str]], Pipeline, dict[str, str]]:
    """This rank's stage modules (one, or one per chunk when interleaved) after ``wrap`` (TP, FSDP), each one's
    parameter names in the whole model, its pipeline and the process-group names of the groups it made.

    ``example``: the input ids of one of this rank's micro-batches, for a ``model`` on the meta device (a rehearsal
    on a fake process group, which moves no data: stages could not tell each other their shapes at the first step
    as they do on live ranks); each stage's input and output shapes are then worked out from it by running the
    chain on the meta device (`stage_shapes`)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    virtual = len(plan.stages)
    chunks = plan.chunks
    pp = virtual // chunks
    index = mesh.get_local_rank("pp")
    mine = list(range(index, virtual, pp))  # interleaved: stage v runs on device v % pp
    layers = stage_layers(model, plan)
    found = own_cut(model, layers)
    parts = [make_stage(model, layers, v, found=found) for v in mine]
    shards = plan.grid[1] if plan.sp else 1
    for part in parts:
        part.shards = shards
    shapes = stage_shapes(model, layers, example, shards=shards, found=found) if example is not None else None
    # weights both ends hold (the tied head): a group per (dp, tp) position with the twin rank
    groups: dict[str, str] = {}
    tied = []
    tied_group = None
    per_stage = mesh.size() // pp
    rank = dist.get_rank()
    # a weight both ends hold (not one a stage reads twice itself: RoBERTa's head bias)
    ends = (make_stage(model, layers, 0, found=found), make_stage(model, layers, virtual - 1, found=found))
    across = {id(p) for p in ends[0].parameters()} & {id(p) for p in ends[1].parameters()}
    if _tied_names(model, None, across):
        for offset in range(per_stage):
            group = dist.new_group([offset, (pp - 1) * per_stage + offset])  # every rank takes part in creating it
            if rank % per_stage == offset and index in (0, pp - 1):
                groups[group.group_name] = "pp"
                tied_group = group
    shared = [(part, _tied_names(model, part, across)) for part in parts]
    canonical = {id(p): name for name, p in model.named_parameters()}  # before wrapping replaces any parameter
    names = [{name: canonical[id(p)] for name, p in part.named_parameters()} for part in parts]
    wrapped = [wrap(part) for part in parts]
    for part, twins in shared:  # looked up after wrapping: FSDP replaces parameters with sharded ones
        params = dict(part.named_parameters())
        tied += [(params[name], tied_group) for name in twins if name in params]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    stage_class = _sharded_stage(plan.zero) if plan.zero > 1 else PipelineStage
    if shapes:
        stage_class = type(f"Rehearsed{stage_class.__name__}", (_Rehearsed, stage_class), {})
    stages = [stage_class(w, v, virtual, device, group=mesh.get_group("pp"),
                          **(dict(zip(("input_args", "output_args"), shapes[v])) if shapes else {}))
              for w, v in zip(wrapped, mine)]
    chain = HF_CHAINS.get(parts[0].kind)
    loss = shifted_lm_loss if chain is not None and chain.shifted else lm_loss
    inputs, target = chain.inputs if chain else "input_ids", "labels"
    if parts[0].kind == "fx":  # a model of one's own: the loss its forward computes, its inputs' names
        loss = ends[1].loss_fn
        inputs, target = parts[0].inputs, parts[0].target
    if chunks > 1:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=micro_batches, loss_fn=loss, scale_grads=True)
    else:
        schedule_class = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
        schedule = schedule_class(stages[0], n_microbatches=micro_batches, loss_fn=loss, scale_grads=True)
    return wrapped, names, Pipeline(index, pp, schedule, tied, inputs, target), groups


def stage_shapes(model: nn.Module, layers: list[list[int]], example: torch.Tensor, *,
                 shards: int = 1, found: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each stage's input and output (meta tensors) for the micro-batch of input ids ``example``: the chain of
    stages of ``model`` (on the meta device, every stage's modules still in it) run one after another on the meta
    device, under a fake tensor mode (a model's own checks of its inputs' values, such as Hugging Face's look for
    packed sequences, are skipped on fake tensors, as when it is traced). ``shards``: the sequence shards a stage
    hands on under sequence parallelism (its tp), which divide its boundaries' dim 1; ``found``: as for
    `make_stage`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("stage shapes are worked out on the meta device: build the model there")
    found = own_cut(model, layers) if found is None else found
    seen = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(example.shape, dtype=example.dtype, device="meta")
        for v in range(len(layers)):  # with autograd: a stage sends gradients back for what requires them
            out = make_stage(model, layers, v, found=found)(x)
            seen.append((x, out))
            x = out

    def meta(t: torch.Tensor, shards: int = 1) -> torch.Tensor:  # a plain meta tensor of the fake one's kind
        shape = (t.shape[0], t.shape[1] // shards, *t.shape[2:]) if shards > 1 else t.shape
        return torch.empty(shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)

    last = len(seen) - 1
    return [(meta(a, 1 if v == 0 else shards), meta(b, 1 if v == last else shards)) for v, (a, b) in enumerate(seen)]


class _Rehearsed:
    """A stage on a fake process group, built with its shapes (`stage_shapes`). Before the first step, live stages
    vote along the pipeline on whether every stage knows its shapes (a send and a receive each way); on a fake
    group a receive brings nothing, so each stage would read a "no" and ask its peers for shapes that never come.
    Here every stage knows them, so the vote is taken as it would end, without the messages of the first step's
    warm-up, which a live rank sends once and its counted steps do not hold."""

    def _warmup_forward_vote(self, has_backward: bool, received_acc: torch.Tensor | None = None) -> torch.Tensor:
        return _static_vote()

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        return _static_vote()


def _static_vote() -> torch.Tensor:
    """The vote's outcome, "every stage's shapes are known": a constant, which the schedule can read also under
    a fake tensor mode (it keeps the value of a tensor made from data)."""
    return torch.tensor([1], dtype=torch.int32)


def _sharded_stage(zero: int) -> type:
    """A `PipelineStage` whose FSDP2 units reduce-scatter their gradients after every micro-batch's backward, as
    ZeRO 2 and 3 do and the cost model prices them (`autopar.cost.memory.gradient_sync`); under ZeRO 3 they also
    drop their gathered weights after each backward (each forward and backward gathers again), under ZeRO 2 only
    after the last. PyTorch's own stage keeps every FSDP2 module's gradients whole until the last backward and
    reduce-scatters once (ZeRO 1), whatever the module was sharded for."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import stage_backward

    class ShardedStage(PipelineStage):
        def backward_maybe_with_nosync(  # noqa: ANN202
            self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False,
        ):
            if backward_type != "full" or not isinstance(self.submod, FSDPModule):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            self.submod.set_is_last_backward(True)  # FSDP2 finishes its reduce-scatters after each backward
            self.submod.set_reshard_after_backward(zero == 3 or last_backward)
            self.submod.set_requires_gradient_sync(True)
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
            return grads, None

    ShardedStage.__name__ = ShardedStage.__qualname__ = f"ZeRO{zero}Stage"
    return ShardedStage


def _tied_names(model: nn.Module, part: nn.Module | None, across: set[int]) -> list[str]:
    """Names (in ``part``, or anywhere when ``part`` is None) of parameters the whole model uses twice, among
    those ``across`` (by id: held by the first stage and the last)."""
    seen: dict[int, int] = {}
    for p in (p for m in model.modules() for p in m._parameters.values() if p is not None):
        seen[id(p)] = seen.get(id(p), 0) + 1
    twice = {key for key, n in seen.items() if n > 1} & across
    if part is None:
        return ["tied"] if twice else []
    return [name for name, p in part.named_parameters(remove_duplicate=False) if id(p) in twice]
