"""Which modules LoRA's `target_modules` adapt: the trainer checks them as it applies the adapters
(engines/lora.py), and preflight on the model built on the meta device, before anything runs.

The merged weights the trainer saves and sends to the rollout engines are W + (alpha/rank)·B·A of linear
layers. So a name must match linear layers: an embedding (peft adapts those too, with other tensors) is
refused, and so is the output layer of a model whose output layer shares its weight with the input embeddings
(tie_word_embeddings): its merged weight would no longer be the embedding's, which the engines load for both.
"""

from __future__ import annotations

from typing import Any

HEADS = ("score", "classifier")  # scalar heads (reward model, critic): trained in full, not adapted


def layers_of(model: Any) -> tuple[dict[str, str], str | None]:
    """(each named module -> "linear", "embedding" or its class name; the output layer's name where it is
    tied to the input embeddings, else None) of a torch model."""
    import torch

    def kind(m: Any) -> str:  # transformers' Conv1D (GPT-2) is a linear layer stored transposed (fan_in_fan_out)
        linear = isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
        return "linear" if linear else "embedding" if isinstance(m, torch.nn.Embedding) else type(m).__name__

    layers = {n: kind(m) for n, m in model.named_modules() if n}
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = out is not None and getattr(model.config, "tie_word_embeddings", False)
    return layers, next((n for n, m in model.named_modules() if m is out), None) if tied else None


def target_problem(targets: tuple[str, ...], layers: dict[str, str], tied_output: str | None,
                   heads: tuple[str, ...] = ()) -> str | None:
    """Why `targets` cannot adapt the model `layers_of` described (None where each name matches linear layers
    only): a name matching no module, or only the score `heads` (a scalar model's, trained in full), or a
    module that is no linear layer, or the tied output layer. A name matches a module's last part(s)
    (q_proj matches model.layers.0.self_attn.q_proj), as peft matches it."""
    linear = ", ".join(sorted({n.rsplit(".", 1)[-1] for n, kind in layers.items() if kind == "linear"
                               and n not in heads and n != tied_output}))
    for t in targets:
        hits = [n for n in layers if n == t or n.endswith("." + t)]
        other = next((h for h in hits if layers[h] != "linear"), None)
        if not hits or all(h in heads for h in hits):
            why = "is the score head, which trains in full" if hits else "matches no module of the model"
        elif other is not None:
            why = (f"matches {other}, a{'n' * (layers[other][0] in 'aeiou')} {layers[other]}: adapters are merged "
                   f"into linear layers only")
        elif tied_output in hits:
            why = (f"matches the output layer {tied_output}, whose weight is the input embeddings' "
                   f"(tie_word_embeddings): merged, it would no longer be theirs")
        else:
            continue
        return f"{t!r} {why}; the model's linear layers: {linear} (or all-linear)"
    return None
