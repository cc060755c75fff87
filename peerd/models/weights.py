"""Read model weights lazily from the files a job can start from: a peerd model file or Hugging Face weights.

``open_weights(path)`` accepts

- a peerd model file (``model.pt`` written by ``peerd fetch``) or the directory holding it: its
  keys are ``layers.<i>.*`` (``LayerStack`` order) and it names its model (``description``);
- a ``.safetensors`` file, a ``save_pretrained`` directory (``model.safetensors``, a sharded
  ``model.safetensors.index.json`` or ``pytorch_model.bin``) or a raw ``.bin``/``.pt`` state dict:
  HF model keys (``transformer.h.0.attn...``), which the model family maps onto its layers.

Tensors are read only when asked for (safetensors reads one tensor at a time, torch files are
memory-mapped), so a stage that loads its own layers never holds the whole checkpoint in memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peerd.errors import ConfigError

MODEL_FILE = "model.pt"
MODEL_FORMAT = 2  # 1: GPT only ("config" is a GPTConfig mapping); 2: "model" names the family


@dataclass
class WeightSource:
    """Named tensors in a file, read on demand; ``description`` is the model a peerd file says it holds."""

    path: Path
    getters: dict[str, Callable[[], torch.Tensor]]
    description: dict[str, Any] | None = None
    """``{"family", "config", "seed"}`` of a peerd model file; None for HF weights."""
    meta: dict[str, Any] | None = None
    """The rest of a peerd model file's header (job, step, format)."""

    @property
    def stack_keys(self) -> bool:
        """Keys follow ``LayerStack`` (``layers.<i>.*``) rather than an HF model's names."""
        return self.description is not None

    def keys(self) -> set[str]:
        return set(self.getters)

    def tensor(self, key: str) -> torch.Tensor:
        return self.getters[key]()


def _fail(field: str, path: Path, why: str) -> ConfigError:
    return ConfigError(field, f"{path}: {why}")


def _torch_file(path: Path, field: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many kinds for a file that is not its format
        raise _fail(field, path, f"not a readable torch file ({type(exc).__name__}: {exc})") from None


def _eager(state: dict[str, Any], path: Path, field: str) -> dict[str, Callable[[], torch.Tensor]]:
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise _fail(field, path, f"entry {bad[0]!r} is not a named tensor")
    return {k: _constant(v) for k, v in state.items()}


def _constant(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor


def _reader(handle: Any, key: str) -> Callable[[], torch.Tensor]:
    return lambda: handle.get_tensor(key)


def _safetensors(files: list[Path], field: str) -> dict[str, Callable[[], torch.Tensor]]:
    from safetensors import safe_open

    getters: dict[str, Callable[[], torch.Tensor]] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:
            raise _fail(field, file, f"not a readable safetensors file ({exc})") from None
        for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
            getters[key] = _reader(handle, key)
    return getters


def _peerd_file(path: Path, payload: dict[str, Any], field: str) -> WeightSource:
    fmt = payload.get("format")
    description: Any
    if fmt == 1:  # written before model families: always a built-in GPT
        description = {"family": "gpt", "config": payload.get("config"), "seed": 0}
    elif fmt == MODEL_FORMAT:
        description = payload.get("model")
    else:
        raise _fail(field, path, f"peerd model file of unknown format {fmt!r} (this peerd reads 1, 2)")
    state = payload.get("state_dict")
    if not isinstance(description, dict) or not isinstance(state, dict):
        raise _fail(field, path, "peerd model file without its model description or weights")
    meta = {k: v for k, v in payload.items() if k not in ("state_dict", "model", "config")}
    return WeightSource(path, _eager(state, path, field), description, meta)


def open_weights(path: str | Path, field: str = "init_checkpoint") -> WeightSource:
    """The weights at ``path`` (see the module docstring); ConfigError naming ``field`` when unreadable."""
    p = Path(path)
    if not p.exists():
        raise _fail(field, p, "no such file or directory (weights are read from this path on every peer)")
    if p.is_dir():
        candidates = [
            (MODEL_FILE, "peerd"),
            ("model.safetensors", "safetensors"),
            ("model.safetensors.index.json", "index"),
            ("pytorch_model.bin", "torch"),
        ]
        for name, kind in candidates:
            if (p / name).is_file():
                return _open_file(p / name, kind, field)
        raise _fail(
            field, p, f"a directory without weights (looked for {', '.join(n for n, _ in candidates)})"
        )
    if p.name.endswith(".safetensors"):
        return _open_file(p, "safetensors", field)
    if p.name.endswith(".index.json"):
        return _open_file(p, "index", field)
    return _open_file(p, "peerd", field)  # a torch file: a peerd model file or a raw state dict


def _open_file(p: Path, kind: str, field: str) -> WeightSource:
    if kind == "safetensors":
        return WeightSource(p, _safetensors([p], field))
    if kind == "index":
        try:
            weight_map = json.loads(p.read_text())["weight_map"]
            files = sorted({p.parent / str(f) for f in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _fail(field, p, f"not a safetensors index ({exc})") from None
        return WeightSource(p, _safetensors(files, field))
    payload = _torch_file(p, field)
    if not isinstance(payload, dict):
        raise _fail(field, p, f"holds a {type(payload).__name__}, not weights")
    if "format" in payload:
        return _peerd_file(p, payload, field)
    return WeightSource(p, _eager(payload, p, field))
