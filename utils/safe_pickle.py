"""Read a pickled PyTorch file of foreign model objects (YOLOv5, Ultralytics) without running anything in it.

A YOLOv5 checkpoint is a pickle of whole `nn.Module` objects, so `torch.load(weights_only=True)`
refuses it and `torch.load(weights_only=False)` would import and run whatever the file names.
`load_untrusted` sits in between: torch's zip reader rebuilds the tensors, and our unpickler
decides what every global in the file becomes:

- tensor rebuilding and an allow-list of plain data types are honoured;
- a global from a module that can reach the system (os, subprocess, builtins' eval and the
  like, see REFUSED_MODULES) refuses the whole file before anything is called;
- every other class or function becomes an inert `Placeholder`: constructing or "calling" it
  records its arguments and state as plain data. Nothing is imported, nothing executed.

The result is the checkpoint's object tree with modules as placeholders whose `state` holds
`_parameters`, `_buffers`, `_modules` and attributes; utils/convert.py reads weights from it.
"""

from __future__ import annotations

import collections
import pickle
import types
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:  # numpy >= 2 moved the array internals to numpy._core
    from numpy._core.multiarray import scalar as numpy_scalar
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import scalar as numpy_scalar

from utils.errors import ConfigError

# Whole modules whose globals are refused, with their submodules. A pickle that names one of
# these is either malicious or not a checkpoint; placeholders would keep it inert, but refusing
# tells the user what the file tried.
REFUSED_MODULES = frozenset(
    {
        "os", "posix", "nt", "subprocess", "sys", "shutil", "socket", "importlib", "runpy", "pickle",
        "_pickle", "marshal", "code", "codeop", "ctypes", "webbrowser", "pty", "commands", "platform",
        "multiprocessing", "threading", "_thread", "signal", "tempfile", "io", "_io", "pdb", "timeit",
        "asyncio", "http", "urllib", "ftplib", "smtplib", "telnetlib", "requests", "pip", "setuptools",
        "distutils", "inspect", "ast", "operator", "functools", "types", "gc", "site", "sysconfig",
        "builtins", "__builtin__", "torch.hub", "torch.jit", "torch.ops", "torch.utils.cpp_extension",
    }
)  # fmt: skip


class UnsafePickleError(ConfigError):
    """The file names a global that could run code; it was refused before anything was called."""


class Placeholder:
    """An object of a class (or the result of a function) the file named but we never imported.

    `source` is the dotted name from the file. `args` holds constructor/call arguments, `state`
    what pickle would have passed to `__setstate__` (for an nn.Module: its `__dict__`), `items`
    and `entries` what it would have appended or set. No method of the real class ever runs.
    """

    source = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Placeholder:
        # Pickle's NEWOBJ calls __new__ without __init__, so the record is set up here.
        self = super().__new__(cls)
        self.args = args
        self.kwargs = kwargs
        self.state = None
        self.items = []
        self.entries = {}
        return self

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.entries[key] = value

    def append(self, value: Any) -> None:
        """Record a list item (pickle's APPEND on a list subclass)."""
        self.items.append(value)

    def extend(self, values: Any) -> None:
        """Record list items (pickle's APPENDS)."""
        self.items.extend(values)

    @property
    def class_name(self) -> str:
        """The last part of `source` (`models.common.C3` -> `C3`)."""
        return self.source.rsplit(".", 1)[-1]

    def attribute(self, name: str, default: Any = None) -> Any:
        """Return an attribute from the recorded state (a dict, or the dict of a (dict, slots) pair)."""
        state = self.state
        if isinstance(state, tuple) and state and isinstance(state[0], dict):
            state = state[0]
        return state.get(name, default) if isinstance(state, dict) else default

    def __repr__(self) -> str:
        return f"<placeholder {self.source}>"


def _rebuild_from_type(func: Any, new_type: Any, args: tuple, state: Any) -> Any:
    """Safe stand-in for torch._tensor._rebuild_from_type_v2: rebuild the tensor, drop a foreign subclass."""
    if func not in _TENSOR_REBUILDERS:
        raise UnsafePickleError(f"tensor rebuilt with the non-allowed function {func!r}")
    tensor = func(*args)
    if new_type is torch.nn.Parameter and not isinstance(tensor, torch.nn.Parameter):
        tensor = torch.nn.Parameter(tensor, requires_grad=tensor.requires_grad)
    return tensor


def _numpy_reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """Safe stand-in for numpy's array reconstructor: plain ndarrays only."""
    if subtype is not np.ndarray:
        raise UnsafePickleError(f"numpy array of the non-allowed type {subtype!r}")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def _copyreg_reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """Safe stand-in for copyreg._reconstructor (pickle protocol 0/1 objects): placeholders and data only."""
    if isinstance(cls, type) and issubclass(cls, Placeholder):
        return cls()
    if cls in (collections.OrderedDict, dict, list, set):
        return cls()
    raise UnsafePickleError(f"object of the non-allowed type {cls!r}")


_TENSOR_REBUILDERS = {
    torch._utils._rebuild_tensor,
    torch._utils._rebuild_tensor_v2,
    torch._utils._rebuild_parameter,
    torch._utils._rebuild_parameter_with_state,
}
_DTYPES = {name: getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "range"): range,
    ("__builtin__", "set"): set,
    ("_codecs", "encode"): lambda text, encoding="utf-8": text.encode(encoding),  # how protocol 2 stores bytes
    ("copyreg", "_reconstructor"): _copyreg_reconstructor,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): torch._utils._rebuild_parameter_with_state,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("numpy", "dtype"): np.dtype,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy.core.multiarray", "scalar"): numpy_scalar,
    ("numpy._core.multiarray", "scalar"): numpy_scalar,
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
}


def _is_refused(module: str, name: str) -> bool:
    """True when (module, name) is outside the allow-list and in (or under) a refused module."""
    parts = module.split(".")
    return any(".".join(parts[:depth]) in REFUSED_MODULES for depth in range(1, len(parts) + 1))


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler whose `find_class` never imports: allow-listed globals, placeholders, or refusal."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._placeholders: dict[str, type[Placeholder]] = {}

    def find_class(self, module: str, name: str) -> Any:
        """Resolve a global named by the file (GLOBAL / STACK_GLOBAL opcodes)."""
        allowed = ALLOWED_GLOBALS.get((module, name))
        if allowed is not None:
            return allowed
        if _is_refused(module, name):
            raise UnsafePickleError(f"refused: the pickle names {module}.{name}, which could run code")
        source = f"{module}.{name}"
        if source not in self._placeholders:
            self._placeholders[source] = type(name, (Placeholder,), {"source": source})
        return self._placeholders[source]


# torch.load(pickle_module=...) wants a module-like object with an Unpickler class (and load).
_PICKLE_MODULE = types.SimpleNamespace(
    __name__="restricted_pickle",
    Unpickler=RestrictedUnpickler,
    load=lambda file, **kwargs: RestrictedUnpickler(file, **kwargs).load(),
)


def load_untrusted(path: Path | str) -> Any:
    """Load a torch zip checkpoint of pickled objects with `RestrictedUnpickler`; tensors land on the CPU.

    Raises UnsafePickleError (a ConfigError, one line naming the file and the global) when the
    file names anything that could run code, and ConfigError when it is not a readable zip
    checkpoint. Nothing in the file is imported or executed in either case.
    """
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise ConfigError(f"{path}: not a PyTorch zip checkpoint (corrupt, or saved by torch < 1.6)")
    try:
        return torch.load(path, map_location="cpu", pickle_module=_PICKLE_MODULE, weights_only=False)
    except UnsafePickleError as error:
        raise UnsafePickleError(f"{path}: {error}; nothing from the file was executed") from None
    except (pickle.UnpicklingError, RuntimeError, TypeError, ValueError, AttributeError, EOFError) as error:
        raise ConfigError(f"{path}: cannot be read as a checkpoint: {str(error).splitlines()[0][:200]}") from error
