"""The independent reference for model plugins: Hugging Face transformers on the same checkpoint.

    ref = HFReference(checkpoint_dir)
    ref.logits([5, 80, 17])          # float32 [3, vocab]: every position's next-token logits
    ref.greedy([5, 80, 17], 16)      # 16 greedy tokens (argmax; EOS does not stop it)
    ref.embedding([5, 80, 17], "mean", normalize=True)   # a pooled final hidden state
    assert_logits_close(ours, ref.logits(tokens))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class HFReference:
    """transformers' own modeling code for `path`, in eval mode on the CPU (float32 by default)."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32, **load_options: Any) -> None:
        """`load_options` go to `from_pretrained` (e.g. a `quantization_config` override)."""
        from transformers import AutoModelForCausalLM

        self.path = Path(path)
        self.model: Any = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype, **load_options).eval()

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """float32 `[len(tokens), vocab]`: row i holds the logits of the token after tokens[:i + 1]."""
        return self.model(torch.tensor([tokens])).logits[0].float()

    @torch.inference_mode()
    def greedy(self, tokens: list[int], max_new_tokens: int) -> list[int]:
        """`max_new_tokens` argmax continuations (what rxf produces with temperature 0 and
        ignore_eos), each from a full forward over the sequence so far (no cache to get wrong)."""
        seq = list(tokens)
        for _ in range(max_new_tokens):
            seq.append(int(self.logits(seq)[-1].argmax()))
        return seq[len(tokens) :]

    @torch.inference_mode()
    def embedding(self, tokens: list[int], method: str, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
        """float32 `[hidden or dimensions]`: the final hidden states (transformers' base model's
        `last_hidden_state`, the final norm applied) pooled as sentence-transformers pools them
        ("last": the last token's, "mean": the mean over all), truncated, then L2-normalised."""
        states = self.model.model(torch.tensor([tokens])).last_hidden_state[0].float()
        vector = states[-1] if method == "last" else states.mean(dim=0)
        vector = vector[:dimensions]
        return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    """Equal within `rtol` elementwise and `rtol` times the largest |reference logit| absolutely
    (a purely relative bound is meaningless for logits near zero)."""
    torch.testing.assert_close(ours.float(), ref.float(), rtol=rtol, atol=rtol * ref.abs().max().item())
