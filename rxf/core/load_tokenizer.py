"""A checkpoint's tokenizer, as `AutoTokenizer` picks it, without importing the model's config class.

`AutoTokenizer.from_pretrained` loads the checkpoint's config to choose the tokenizer class, and of
that config it reads only fields that config.json holds as they are (model_type, _name_or_path,
tokenizer_class, auto_map). Loading it through `AutoConfig` imports the model's configuration
module, which in transformers 5 imports torch.distributed.tensor and sympy: ~0.9 s of CPU in each
of rxf's three processes at start-up, where the front end and the detokenizer need nothing else
of the model. A generic `PreTrainedConfig` read from the same config.json carries those fields
(and is what AutoTokenizer itself falls back to when AutoConfig cannot load a config).
"""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str) -> Any:
    """`AutoTokenizer.from_pretrained(path)`'s tokenizer (a directory with or without config.json)."""
    from transformers import AutoTokenizer, PreTrainedConfig

    config = None
    if os.path.isfile(os.path.join(path, "config.json")):
        # As AutoConfig.from_pretrained does: the path is the config's name_or_path.
        config_dict, kwargs = PreTrainedConfig.get_config_dict(path, name_or_path=path)
        config = PreTrainedConfig.from_dict(config_dict, **kwargs)
    return AutoTokenizer.from_pretrained(path, config=config)
