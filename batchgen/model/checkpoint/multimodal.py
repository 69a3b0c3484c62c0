"""Multimodal checkpoints run as text models: a job's rows are text, so only the language model
and its LM head load; the vision tower and the projector that feeds image features into the
language model are neither read nor allocated.

Which wrappers qualify is a table, not a guess: a wrapper qualifies when its text path is its
language model unchanged (no image-prefix mask, no 3-D positions for text) and its weights sit
under the `language_model` prefix. Gemma 3 (Gemma3ForConditionalGeneration) and Mistral Small
3.1/3.2 (Mistral3ForConditionalGeneration) are; Qwen2-VL's M-RoPE or PaliGemma's prefix-LM
mask are not, and those wrappers are left to the rules for any other config.

A text model's names are the language model's with the prefix taken off. transformers 4
wrote `language_model.model.X` and `language_model.lm_head.X`, transformers 5 holds
`model.language_model.X` and `lm_head.X` (and saves the former): both map to `model.X` and
`lm_head.X`, the names of the text family's own causal LM.
"""

from __future__ import annotations

import re

# model_type -> the wrapper class (its text_config is the text model)
TEXT_MODEL_WRAPPERS = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
}
_IMAGE_PARTS = ("vision_tower.", "multi_modal_projector.")
# checkpoint name -> text model name (transformers' from_pretrained `key_mapping` form)
KEY_MAPPING = {
    r"^language_model\.model\.": "model.",
    r"^model\.language_model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def is_text_wrapper(hf: dict) -> bool:
    """config.json (hf) is a multimodal wrapper whose language model runs text jobs alone."""
    return hf.get("model_type") in TEXT_MODEL_WRAPPERS and isinstance(hf.get("text_config"), dict)


def language_config(hf: dict) -> dict:
    """The config.json of the model that runs a text job: a wrapper's text_config (its
    model_type that of the text family), else hf itself."""
    return hf["text_config"] if is_text_wrapper(hf) else hf


def text_name(name: str) -> str:
    """A checkpoint tensor's name in the text model (unchanged outside a wrapper's layout)."""
    for pattern, replacement in KEY_MAPPING.items():
        name, n = re.subn(pattern, replacement, name)
        if n:
            return name
    return name


def is_language_model(name: str) -> bool:
    """A wrapper's checkpoint tensor (or adapted module) that the text model loads: any but
    the vision tower's and the projector's."""
    return not name.removeprefix("model.").startswith(_IMAGE_PARTS)
