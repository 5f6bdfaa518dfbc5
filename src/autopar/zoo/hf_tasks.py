"""Which task head a Hugging Face model type is built with, and the example inputs of one training step per task.

The heads come from transformers' own auto mappings (no list of types here): causal LM, sequence-to-sequence LM,
masked LM, speech-to-text and image classification. A type in several takes the first of:

1. sequence-to-sequence LM (t5, bart, marian, ...), then speech-to-text (whisper): their causal-LM class, where
   one exists, is the decoder half alone;
2. masked LM (bert, roberta, ...): an encoder's causal-LM class is the encoder run as a decoder, which the default
   config does not ask for;
3. causal LM: every decoder-only type;
4. image classification (vit, convnext, ...).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch

# task -> the transformers auto mapping of model type -> class name; in order of preference
TASK_MAPPINGS = (
    ("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
)
TASKS = tuple(task for task, _ in TASK_MAPPINGS)
LANGUAGE_TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")


@dataclass(frozen=True, slots=True, kw_only=True)
class Head:
    """The class a type is built as, and its task (one of `TASKS`)."""

    model_type: str
    task: str
    class_name: str


def transformers_module() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise ImportError(
            "hf: models need Hugging Face transformers; install it with `pip install 'autopar[hf]'`"
        ) from exc


@functools.cache
def heads() -> dict[str, Head]:
    """Every type the installed transformers can build with one of the tasks' heads, by model type."""
    transformers_module()
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    found: dict[str, Head] = {}
    for task, mapping in TASK_MAPPINGS:
        for model_type, class_name in getattr(auto, mapping, {}).items():
            if isinstance(class_name, (tuple, list)):  # several classes for one type: the first is the default
                class_name = class_name[0]
            found.setdefault(model_type, Head(model_type=model_type, task=task, class_name=class_name))
    return dict(sorted(found.items()))


def head_of(model_type: str) -> Head | None:
    return heads().get(model_type)


def example_inputs(task: str, *, batch: int, seq: int, frames: int, mel_bins: int, channels: int,
                   dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Keyword inputs of one training step of ``task`` (values are zeros; `autopar run` draws its own):

    - causal and masked LM: ``input_ids`` and ``labels`` [batch, seq];
    - sequence-to-sequence LM: those and ``decoder_input_ids`` [batch, seq];
    - speech-to-text: ``input_features`` [batch, mel_bins, frames], ``decoder_input_ids`` and ``labels``
      [batch, seq];
    - image classification: ``pixel_values`` [batch, channels, seq, seq] and ``labels`` [batch].
    """
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if task == "image-classification":
        return {"pixel_values": torch.zeros(batch, channels, seq, seq, dtype=dtype, device=device),
                "labels": torch.zeros(batch, dtype=torch.long, device=device)}
    if task == "speech-seq2seq":
        return {"input_features": torch.zeros(batch, mel_bins, frames, dtype=dtype, device=device),
                "decoder_input_ids": ids, "labels": ids.clone()}
    if task == "seq2seq-lm":
        return {"input_ids": ids, "decoder_input_ids": ids.clone(), "labels": ids.clone()}
    return {"input_ids": ids, "labels": ids.clone()}
