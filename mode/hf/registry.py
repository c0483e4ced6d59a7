"""The table of Hugging Face families: ``model_type`` -> its adapter (``mode.hf.family.Family``).

Reading looks a checkpoint's ``model_type`` up here; writing asks the families in this
order which one ``holds`` a model (the dense ones by architecture, then the MoE ones by
their MoE's features, Mixtral last: it holds every other MoE). Adding a family is one
adapter module and one row.
"""

from __future__ import annotations

from mode.hf.family import Family
from mode.hf.gpt2 import GPT2
from mode.hf.llama import LLAMA, MISTRAL, QWEN2
from mode.hf.moe_families import MIXTRAL, OLMOE, QWEN2_MOE

FAMILIES: dict[str, Family] = {
    family.name: family for family in (GPT2(), QWEN2, LLAMA, MISTRAL, OLMOE, QWEN2_MOE, MIXTRAL)
}
MOE_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.moe)
WRITTEN = tuple(name for name, family in FAMILIES.items() if family.architecture is not None)
