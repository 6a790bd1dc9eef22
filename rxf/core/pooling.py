"""How an embedding model (`model.task = "embed"`) turns a prompt's final hidden states into one
vector: the pooling method, L2 normalisation, and which truncated sizes it was trained for.

Read once at start-up in the scheduler process from the checkpoint's sentence-transformers files
(`modules.json`, the Pooling module's `config.json`, a `Normalize` module) and `config.json`
(`matryoshka_dimensions`, `is_matryoshka`), then sent to the front end with the engine's figures
(`to_info` / `from_info`): the front end checks each request's `dimensions` against it, and the
scheduler pools, truncates and normalises (`Scheduler._pool`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# sentence-transformers module types (modules.json) and what each means here.
_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
# Pooling config flags -> our method. Any other flag set is refused: its vectors would differ.
_METHODS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class Pooling:
    method: str  # "last": the last prompt token's state; "mean": the mean over every prompt token
    normalize: bool  # L2-normalise (after any truncation to `dimensions`)
    hidden_size: int  # the full embedding size
    # Truncation (`dimensions`): None when any size up to hidden_size may be asked for; an empty
    # list when the checkpoint says it was not trained for truncation; else the sizes it was.
    matryoshka_dimensions: list[int] | None = None

    @classmethod
    def from_checkpoint(
        cls, model_path: str, hf_config: Any, method: str = "auto", normalize: bool | None = None
    ) -> Pooling:
        """The checkpoint's pooling, with the config's overrides (`method` other than "auto",
        `normalize` not None). Raises ValueError for a sentence-transformers pipeline this engine
        cannot reproduce (a Dense layer, max or CLS pooling)."""
        root = Path(model_path)
        st_method, st_normalize = _sentence_transformers(root)
        text = hf_config.get_text_config()
        dims = getattr(text, "matryoshka_dimensions", None)
        if dims is None and getattr(text, "is_matryoshka", None) is False:
            dims = []
        return cls(
            method=method if method != "auto" else st_method or "last",
            normalize=normalize if normalize is not None else bool(st_normalize),
            hidden_size=int(text.hidden_size),
            matryoshka_dimensions=None if dims is None else [int(d) for d in dims],
        )

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why `dimensions` cannot be served (None when it can)."""
        if not 0 < dimensions <= self.hidden_size:
            return f"must be in [1, {self.hidden_size}] (the model's embedding size), got {dimensions}"
        dims = self.matryoshka_dimensions
        if dims is not None and dimensions != self.hidden_size and dimensions not in dims:
            if not dims:
                return "the model was not trained for truncated embeddings (its config says is_matryoshka: false)"
            return f"the model supports only {sorted(dims)}, got {dimensions}"
        return None

    def to_info(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> Pooling:
        return cls(**info)


def _sentence_transformers(root: Path) -> tuple[str | None, bool | None]:
    """(pooling method, normalize) from modules.json, or (None, None) without one."""
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = json.loads(modules_file.read_text())
    method, normalize = None, False
    for module in modules:
        kind = module.get("type", "")
        if kind == _TRANSFORMER:
            continue
        if kind == _NORMALIZE:
            normalize = True
        elif kind == _POOLING:
            method = _pooling_method(json.loads((root / module.get("path", "") / "config.json").read_text()))
        else:
            raise ValueError(f"modules.json: the sentence-transformers module {kind!r} is not supported")
    return method, normalize


def _pooling_method(config: dict[str, Any]) -> str:
    modes = [name for name, on in config.items() if name.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in _METHODS:
        raise ValueError(
            f"1_Pooling/config.json: pooling {modes or 'none'} is not supported; supported: "
            f"{', '.join(_METHODS)} (one of them)"
        )
    if config.get("include_prompt", True) is False:
        raise ValueError("1_Pooling/config.json: include_prompt = false is not supported")
    return _METHODS[modes[0]]
