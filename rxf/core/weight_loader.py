"""Stream checkpoint tensors from a Hugging Face directory and place them into model parameters.

Two halves, both model-agnostic: `iter_safetensors` yields `(name, tensor)` pairs one tensor at a
time (peak host memory is one tensor, not the checkpoint), and `load_named_weights` routes each
pair to a parameter's `weight_loader`, fusing per-projection tensors into stacked parameters, and
a checkpoint's per-layer KV-cache scales to the attention layers' `k_scale` / `v_scale` buffers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"
# (fused parameter name part, checkpoint name part, shard id), e.g. ("qkv_proj", "q_proj", "q").
StackedMapping = Sequence[tuple[str, str, str | int]]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files. With an index, exactly the files it names: repositories often ship a
    second copy of the weights (e.g. Mistral's `consolidated.safetensors`) that must not load twice."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory not found: {root}")
    index = root / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names files that are not in {root}: {', '.join(missing)}")
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        present = ", ".join(sorted(p.name for p in root.iterdir())[:20]) or "nothing"
        raise FileNotFoundError(
            f"no *.safetensors weights in {root} (it holds: {present}); rxf loads safetensors checkpoints only"
        )
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint as `(name, cpu tensor)`, with a progress bar over tensors.

    The directory is checked now (a missing or empty checkpoint raises here, not at first `next`).
    """
    files = safetensors_files(model_dir)
    return _stream(files)


@torch.no_grad()
def fill_random_weights(model: nn.Module, seed: int) -> None:
    """`model.load_format = "random"`: every parameter drawn from U(-1e-3, 1e-3) where it lives, no
    checkpoint read (benchmarks of shapes whose checkpoints would not fit the disk: a Qwen3-30B-A3B
    is 61 GB). Norm weights are 1 so activations keep their scale through the layers; routers are
    random, so a mixture of experts spreads its tokens over all experts, its costliest case.

    Biases are 0: a drawn bias adds the same vector to every token, and gpt-oss's (every projection,
    router and expert, 24 layers) summed to outweigh the token's own embedding (rms 5.8e-4 here), so
    every token took the same few experts and the same next token (a 24-layer, 32-expert tiny gpt-oss,
    64 decoding rows: 5 of 32 experts a layer and one next token; with zero biases 32 and 56), and a
    batch's decode read a fraction of the experts a real one reads."""
    gen: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.device not in gen:
            gen[param.device] = torch.Generator(param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        elif param.is_floating_point():
            param.uniform_(-1e-3, 1e-3, generator=gen[param.device])
        else:
            param.zero_()


def _stream(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    total = 0
    for path in files:  # headers only: cheap, and gives the bar a total; a truncated or corrupt file fails here
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                total += len(f.keys())
        except Exception as exc:  # safetensors' SafetensorError names no file
            raise ValueError(f"{path}: not a readable safetensors file: {exc}") from None
    with tqdm(total=total, desc="Loading weights", unit="tensor", dynamic_ncols=True) as bar:
        for path in files:
            bar.set_postfix_str(path.name, refresh=False)
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update()


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


def kv_scale_targets(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Checkpoint name -> the KV-cache scale buffers it fills. An attention layer's buffer
    `B.attn.k_scale` (B its block, e.g. `model.layers.3.self_attn`) is filled by whichever of the
    names FP8 checkpoints use is present: `B.k_scale` (compressed-tensors, Quark), `B.k_proj.k_scale`
    (ModelOpt), `B.k_proj.output_scale` (older compressed-tensors), the same for v, the deprecated
    `B.kv_scale` (one scale for both) and the buffer's own name."""
    targets: dict[str, list[torch.Tensor]] = {}
    for name, buf in model.named_buffers():
        layer, _, kind = name.rpartition(".")
        if kind not in ("k_scale", "v_scale"):
            continue
        block, proj = layer.rpartition(".")[0], f"{kind[0]}_proj"
        for alias in (name, f"{block}.{kind}", f"{block}.{proj}.{kind}", f"{block}.{proj}.output_scale",
                      f"{block}.kv_scale"):
            targets.setdefault(alias, []).append(buf)
    return targets


def _load_kv_scale(buffers: list[torch.Tensor], loaded: torch.Tensor) -> None:
    if loaded.numel() != 1:
        raise ValueError(f"a KV-cache scale must be per-tensor (one number), got shape {tuple(loaded.shape)}")
    value = float(loaded.float())
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"a KV-cache scale must be a positive finite number, got {value}")
    for buf in buffers:
        buf.fill_(value)


def _sample(names: Sequence[str], limit: int = 20) -> str:
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMapping = (),
    skip: Callable[[str], bool] | None = None,
) -> None:
    """Copy checkpoint tensors into `model`'s parameters, matching names exactly except that a
    checkpoint name containing `.{part}.` of a stacked mapping goes to shard `shard_id` of the fused
    parameter named with `.{fused}.` instead. KV-cache scales go to their buffers (`kv_scale_targets`);
    a checkpoint without them leaves the buffers at 1.0.

    Raises ValueError naming every checkpoint tensor that fits no parameter (and is not skipped) and
    every parameter, or shard of a fused parameter, that no checkpoint tensor filled.
    """
    params = dict(model.named_parameters())
    expected = {(n, s) for n, p in params.items() for s in getattr(p, "shard_ids", (None,))}
    filled: set[tuple[str, str | int | None]] = set()
    unplaced: list[str] = []
    kv_scales = kv_scale_targets(model)
    with torch.no_grad():
        for name, tensor in weights:
            if skip is not None and skip(name):
                continue
            if name in kv_scales:
                try:
                    _load_kv_scale(kv_scales[name], tensor)
                except ValueError as e:
                    raise ValueError(f"cannot load checkpoint tensor {name}: {e}") from None
                continue
            target, shard = name, None
            for fused, part, shard_id in stacked:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                unplaced.append(name)
                continue
            loader = getattr(param, "weight_loader", None)
            try:
                if shard is not None:
                    loader(param, tensor, shard)
                else:
                    (loader or default_weight_loader)(param, tensor)
            except ValueError as e:
                raise ValueError(f"cannot load checkpoint tensor {name} into {target}: {e}") from None
            filled.add((target, shard))
    unfilled = sorted(n if s is None else f"{n} (shard {s})" for n, s in expected - filled)
    if unplaced or unfilled:
        problems = []
        if unplaced:
            problems.append(f"checkpoint tensors with no matching parameter: {_sample(unplaced)}")
        if unfilled:
            problems.append(f"parameters the checkpoint did not fill: {_sample(unfilled)}")
        raise ValueError(f"{type(model).__name__}: weights do not match the model; " + "; ".join(problems))
