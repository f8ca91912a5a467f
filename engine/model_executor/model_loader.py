"""Find a GPT-2-family checkpoint and load its weights by name.

A model name resolves, in order: the built-in ``tiny-gpt2`` (and ``tiny-gpt2-random``); a local
directory; the Hugging Face cache; the Hugging Face hub (download). Every checkpoint, the
built-in ones included, goes through the same checks and ``load_state_dict``. A checkpoint
directory holding a ``SHA256SUMS`` file (as the built-in one does) has every file listed there
verified before use, so a corrupted or truncated file is an error, not a silently wrong model.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine import builtin_model

if TYPE_CHECKING:  # torch is imported where weights are read: the API server resolves names without it
    import torch

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
CHECKSUM_FILE = "SHA256SUMS"
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "tokenizer*", "vocab.json",
                "merges.txt", "special_tokens_map.json"]


class ModelNotFoundError(ValueError):
    """The model name or path could not be resolved to a checkpoint."""


class NotAGPT2CheckpointError(ValueError):
    """The directory exists but is not a GPT-2-architecture checkpoint."""


class ChecksumMismatchError(ValueError):
    """A file of the checkpoint differs from its line in the checkpoint's SHA256SUMS."""


@dataclass
class GPT2Config:
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float
    eos_token_id: int | None
    scale_attn_by_inverse_layer_idx: bool = False

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


def resolve(model: str) -> Path:
    """Model name or path -> local checkpoint directory."""
    if model in builtin_model.NAMES:
        return builtin_model.builtin_path(model)
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotAGPT2CheckpointError(f"model {model!r} is a file; give a checkpoint directory")
        return path
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise ModelNotFoundError(f"model path {model!r} does not exist. "
                                 f"Try the built-in offline model {builtin_model.NAME!r} "
                                 f"(e.g. vllm-trace serve {builtin_model.NAME})")
    return _from_hub(model)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    tried = [f"local directory ./{repo_id} (not found)"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception as e:  # any failure means "not cached"; we say so below
        tried.append(f"Hugging Face cache ({type(e).__name__})")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # any failure: we say which and why below
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        tried.append(f"Hugging Face hub download ({type(e).__name__}: {reason[:160]})")
    raise ModelNotFoundError(
        f"could not load model {repo_id!r}. Tried: " + "; ".join(tried)
        + f". If you are offline, use the built-in model: {builtin_model.NAME}")


def read_config(path: Path) -> GPT2Config:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise NotAGPT2CheckpointError(f"{path} is not a model checkpoint: it has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise NotAGPT2CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    arch = raw.get("model_type")
    if arch != "gpt2":
        raise NotAGPT2CheckpointError(
            f"{path} holds a {arch!r} model; vllm-trace runs GPT-2-architecture checkpoints (model_type 'gpt2')")
    if raw.get("reorder_and_upcast_attn"):
        raise NotAGPT2CheckpointError(f"{path}: reorder_and_upcast_attn=True is not supported")
    if raw.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise NotAGPT2CheckpointError(f"{path}: activation {raw['activation_function']!r} is not supported")
    if not raw.get("scale_attn_weights", True):
        raise NotAGPT2CheckpointError(f"{path}: scale_attn_weights=False is not supported")
    n_embd = raw["n_embd"]
    return GPT2Config(
        vocab_size=raw["vocab_size"], n_positions=raw["n_positions"], n_embd=n_embd,
        n_layer=raw["n_layer"], n_head=raw["n_head"], n_inner=raw.get("n_inner") or 4 * n_embd,
        layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5), eos_token_id=raw.get("eos_token_id"),
        scale_attn_by_inverse_layer_idx=bool(raw.get("scale_attn_by_inverse_layer_idx", False)),
    )


def verify_checksums(path: Path) -> int:
    """Check every file listed in path/SHA256SUMS (``sha256sum`` format); return how many.
    No SHA256SUMS file: nothing to check, 0."""
    sums = path / CHECKSUM_FILE
    if not sums.exists():
        return 0
    n = 0
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        want, name = line.split(maxsplit=1)
        name = name.lstrip("*")
        f = path / name
        if not f.exists():
            raise ChecksumMismatchError(f"{f} is missing (listed in {sums})")
        got = hashlib.sha256(f.read_bytes()).hexdigest()
        if got != want:
            raise ChecksumMismatchError(
                f"{f} is corrupted: its sha256 is {got[:12]}…, {sums.name} says {want[:12]}…. "
                f"Restore the file (e.g. `git checkout -- {name}` in its directory, or reinstall)")
        n += 1
    return n


def check_checkpoint(path: Path) -> None:
    verify_checksums(path)
    read_config(path)
    if not any((path / f).exists() for f in WEIGHT_FILES) and not list(path.glob("model-*.safetensors")):
        raise NotAGPT2CheckpointError(f"{path} has no weights (looked for {', '.join(WEIGHT_FILES)})")
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise NotAGPT2CheckpointError(f"{path} has no tokenizer (looked for {', '.join(TOKENIZER_FILES)})")


def load_state_dict(path: Path, progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """All weights of the checkpoint with the ``transformer.`` prefix removed.
    progress(bytes read, bytes in all): after each tensor of a safetensors file (a .bin file
    is read in one go)."""
    files = sorted(path.glob("model*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors import safe_open
        total, done = sum(f.stat().st_size for f in files), 0
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    state[name] = t = st.get_tensor(name)
                    done += t.numel() * t.element_size()
                    if progress is not None:
                        progress(min(done, total), total)
        if progress is not None:  # the files also hold headers: the last tensor is not quite `total`
            progress(total, total)
    else:
        import torch

        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        if progress is not None:
            size = (path / "pytorch_model.bin").stat().st_size
            progress(size, size)
    return {k.removeprefix("transformer."): v for k, v in state.items()}
