"""Scalar models (reward, cost, critic) saved as plain Hugging Face directories.

A scalar model is the value-head model of ``build_value_model``: a decoder backbone with one
linear output per token (``*ForTokenClassification``, ``num_labels=1``, the head named
``score``). Its score of a response is the output at the response's last token (EOS for a
finished one), exactly as the score op reads ``last_values``. ``save_scalar_model`` writes it so
that anything reads it back without hybridflow::

    model = AutoModelForTokenClassification.from_pretrained(directory)
    score = model(input_ids=prompt_and_response_ids).logits[0, -1, 0]

LoRA adapters are merged into the weights first, so the directory is one plain model; the
tokenizer goes beside it. The way back is the ordinary one: a reward, cost or critic node whose
``source`` is ``{path: DIRECTORY}`` builds its value-head model from the directory with its
trained head (``build_value_model``: ``from_pretrained`` finds the ``score`` weights; a causal
LM directory has none, so its head is new).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

MODEL_CARD = """\
# Scalar model ({role})

Saved by hybridflow. One score per sequence: the output at its last token.

```python
from transformers import AutoModelForTokenClassification, AutoTokenizer
model = AutoModelForTokenClassification.from_pretrained(DIR)
tokenizer = AutoTokenizer.from_pretrained(DIR)
ids = tokenizer(prompt + response, return_tensors="pt", add_special_tokens=False).input_ids
score = model(input_ids=ids).logits[0, -1, 0]
```

The prompt is rendered as the policy saw it (chat template with the generation prompt, for
chat data); the response ends with the tokenizer's EOS token.
"""


def _has_adapters(module: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in module.modules())


def plain_scalar_model(model: nn.Module) -> PreTrainedModel:
    """``model`` as a plain transformers scalar model: a ``PeftModel`` merged into a copy (the
    trained model is untouched), anything else as it is.

    ``TypeError`` for a module holding LoRA layers without its ``PeftModel`` (an engine's
    ``module``: pass its ``peft``), whose ``save_pretrained`` would write adapter names a plain
    model ignores; ``ValueError`` for a model that is not one score per token.
    """
    from peft import PeftModel

    if isinstance(model, PeftModel):
        model = copy.deepcopy(model).merge_and_unload()
    elif _has_adapters(model):
        raise TypeError("this module holds LoRA layers: pass the PeftModel that wraps it, to merge them")
    config = getattr(model, "config", None)
    if not isinstance(model, PreTrainedModel) or not type(model).__name__.endswith("ForTokenClassification"):
        raise ValueError(f"expected a *ForTokenClassification scalar model, got {type(model).__name__}")
    if config.num_labels != 1:
        raise ValueError(f"expected a scalar model (num_labels=1), got num_labels={config.num_labels}")
    return model


def save_scalar_model(
    model: nn.Module,
    directory: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase | None = None,
    role: str = "reward",
) -> Path:
    """Write ``model`` (``plain_scalar_model``) and ``tokenizer`` to ``directory`` as a plain HF
    model, with a short model card saying how its score is read; returns the directory.

    The files are written into a scratch directory beside it and renamed into place: a reader
    never sees half a model, and an older model there is replaced whole.
    """
    plain = plain_scalar_model(model)
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        plain.save_pretrained(scratch)
        config = copy.deepcopy(plain.config)  # the caller's model keeps its own
        # Dropout on the head is off in eval mode anyway; 0 keeps a train-mode reader exact too.
        config.classifier_dropout = 0.0
        config.id2label, config.label2id = {0: role}, {role: 0}
        config.save_pretrained(scratch)
        if tokenizer is not None:
            tokenizer.save_pretrained(scratch)
        (scratch / "README.md").write_text(MODEL_CARD.format(role=role), encoding="utf-8")
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, old / target.name)
            os.replace(scratch, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
