"""Where one layer's tensors come from: an in-memory mapping, or a Hugging Face checkpoint
directory of safetensors shards read lazily. Both record which names a reader took, so that a
tensor under the layer's prefix that no reader consumed is an error, never silently dropped.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` (``{"weight_map": {name: shard file}}``) with its shards.
Tensors are read one at a time with the ``safetensors`` package (memory-mapped), so host memory
stays bounded by the tensors a reader keeps.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# dtypes safetensors' numpy reader looks up as attributes of numpy, which numpy lacks
_NUMPY_ALIASES = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
                  "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu}


@contextlib.contextmanager
def _float8_readable():
    """Let safetensors' numpy reader find the float8 dtypes (ml_dtypes') for the duration."""
    added = [n for n in _NUMPY_ALIASES if not hasattr(np, n)]
    for n in added:
        setattr(np, n, _NUMPY_ALIASES[n])
    try:
        yield
    finally:
        for n in added:
            delattr(np, n)


class TensorSource:
    """Named tensors with a record of which were taken.

    ``take(name, shape=..., dtypes=...)`` returns the tensor as a numpy array (or the array the
    mapping holds) after checking its shape and dtype, raising ``ValueError`` naming the tensor
    otherwise; ``check_consumed(prefix)`` raises naming every tensor under ``prefix`` not taken.
    """

    def __init__(self, names: Sequence[str], where: str):
        self._names = frozenset(names)
        self._taken: set[str] = set()
        self.where = where

    # -- to be provided by a subclass
    def _read(self, name: str) -> Any:
        raise NotImplementedError

    def _meta(self, name: str) -> tuple[tuple[int, ...], str]:
        raise NotImplementedError

    # -- shared
    def __contains__(self, name: str) -> bool:
        return name in self._names

    def names_under(self, prefix: str) -> list[str]:
        return sorted(n for n in self._names if n.startswith(prefix))

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype name) of ``name`` without reading it."""
        self._require(name)
        return self._meta(name)

    def _require(self, name: str) -> None:
        if name not in self._names:
            raise ValueError(f"checkpoint tensor {name!r} is missing (in {self.where})")

    def take(self, name: str, shape: Sequence[int | None] | None = None,
             dtypes: Sequence[str] | None = None) -> Any:
        """The tensor ``name``, checked against ``shape`` (None matches any size) and ``dtypes``."""
        got_shape, got_dtype = self.meta(name)
        if shape is not None and (len(got_shape) != len(shape)
                                  or any(s is not None and s != g for s, g in zip(shape, got_shape))):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"checkpoint tensor {name!r} must have shape {want}, got {list(got_shape)}")
        if dtypes is not None and got_dtype not in dtypes:
            raise ValueError(f"checkpoint tensor {name!r} must have dtype {' or '.join(dtypes)}, got {got_dtype}")
        self._taken.add(name)
        return self._read(name)

    def check_consumed(self, prefix: str) -> None:
        left = [n for n in self.names_under(prefix) if n not in self._taken]
        if left:
            shown = ", ".join(repr(n) for n in left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
            raise ValueError(f"checkpoint tensors under {prefix!r} that no reader consumed: {shown} "
                             f"(in {self.where}); jax_moe does not know what they are for, so it does "
                             f"not drop them silently")


class MappingSource(TensorSource):
    """Tensors from an in-memory mapping ``name -> array`` (numpy, jax, or anything with shape/dtype)."""

    def __init__(self, tensors: Mapping[str, Any]):
        super().__init__(list(tensors), "the given mapping")
        self._tensors = tensors

    def _read(self, name):
        return self._tensors[name]

    def _meta(self, name):
        t = self._tensors[name]
        return tuple(np.shape(t)), np.dtype(t.dtype).name


class SafetensorsDir(TensorSource):
    """Tensors of a checkpoint directory, read lazily shard by shard with ``safetensors``."""

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = os.fspath(model_dir)
        index = os.path.join(self.model_dir, INDEX_FILE)
        single = os.path.join(self.model_dir, SINGLE_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' object")
            self._shard_of = dict(weight_map)
        elif os.path.exists(single):
            from safetensors import safe_open

            with safe_open(single, framework="numpy") as f:
                self._shard_of = {n: SINGLE_FILE for n in f.keys()}
        else:
            raise ValueError(f"model_dir {self.model_dir!r} has neither {INDEX_FILE} nor {SINGLE_FILE}")
        super().__init__(list(self._shard_of), self.model_dir)
        self._handles: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def _handle(self, name: str):
        """The open shard holding ``name``. One shard is open at a time: its memory-mapped pages
        are let go before the next shard is mapped, so resident memory stays near what the
        reader keeps plus one shard."""
        from safetensors import safe_open

        shard = self._shard_of[name]
        if shard not in self._handles:
            path = os.path.join(self.model_dir, shard)
            if not os.path.exists(path):
                raise ValueError(f"checkpoint tensor {name!r} is mapped to shard {shard!r}, which is missing")
            self.close()
            self._handles[shard] = self._stack.enter_context(safe_open(path, framework="numpy"))
        return self._handles[shard]

    def _meta(self, name):
        sl = self._handle(name).get_slice(name)
        return tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype())

    def _read(self, name):
        with _float8_readable():
            return self._handle(name).get_tensor(name)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> "SafetensorsDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# safetensors' dtype tags -> numpy / ml_dtypes names
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool"}


def read_config(model_dir: str | os.PathLike) -> dict:
    """``config.json`` of a checkpoint directory as a dict."""
    path = os.path.join(os.fspath(model_dir), CONFIG_FILE)
    if not os.path.exists(path):
        raise ValueError(f"model_dir {os.fspath(model_dir)!r} has no {CONFIG_FILE}")
    with open(path) as f:
        return json.load(f)
