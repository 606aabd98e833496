"""A failure while recording, as one clear graphmem error naming the model, the phase and the op.

Input: the exception the step raised and the recorder (which knows the op and module being
recorded).  Output: a ``UserInputError`` (the inputs do not fit the model), ``TraceError`` or
``UnsupportedError`` (graphmem cannot record this), with the PyTorch error as its cause.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator

from torch import nn

from graphmem._torch_api import DATA_DEPENDENT_ERRORS, UnsupportedOperatorException
from graphmem.errors import GraphmemError, TraceError, UnsupportedError, UserInputError
from graphmem.job.option import spelling
from graphmem.records import Phase, Role
from graphmem.trace.core.recorder import Recorder

__all__ = ["errors_explained"]

# what a fake tensor says when code reaches for its memory
_DATA_ACCESS = (".numpy() is not supported", "Cannot access data pointer", "Cannot access storage",
                "data_ptr", "is not supported for tensor subclasses")


@contextlib.contextmanager
def errors_explained(recorder: Recorder, model: nn.Module) -> Iterator[None]:
    """Turn exceptions raised while recording into one clear graphmem error."""
    try:
        yield
    except GraphmemError:
        raise
    except DATA_DEPENDENT_ERRORS as exc:
        raise TraceError(f"{_where(recorder, model)} reads a tensor's value: data-dependent control "
                         "flow such as `if x.sum() > 0`, .item(), or an output shape that depends on "
                         "values; graphmem runs on fake tensors that hold no values. Make that code "
                         f"depend on shapes only, or declare what such a read gives with {spelling('assume')} reads=N "
                         "(e.g. a predicted length)") from exc
    except UnsupportedOperatorException as exc:
        raise UnsupportedError(f"{_where(recorder, model)} calls {exc}, an op with no meta/fake "
                               "implementation in this torch; graphmem cannot size it") from exc
    except RecursionError as exc:
        raise UnsupportedError(f"{_where(recorder, model)}: the model nests deeper than graphmem can record "
                               f"(Python's recursion limit, {sys.getrecursionlimit()}, was reached)") from exc
    except (RuntimeError, NotImplementedError) as exc:
        if not any(words in str(exc) for words in _DATA_ACCESS):
            raise _failed(recorder, model, exc) from exc
        raise UnsupportedError(f"{_where(recorder, model)} reads tensor memory directly ({str(exc).strip()}): "
                               "data_ptr() or a storage's bytes, which fake tensors do not have; graphmem cannot "
                               "record it. Keep such code out of forward") from exc
    except Exception as exc:  # broad: the model is user code and may raise anything; reported as its failure
        raise _failed(recorder, model, exc) from exc


def _failed(recorder: Recorder, model: nn.Module, exc: BaseException) -> GraphmemError:
    """Any other failure: the user's inputs on the first forward, else graphmem's own limit.

    Float token ids into an embedding (``--input 8x256`` where ``8x256:int64`` was meant) get
    the input written as it should be."""
    message = f"{_where(recorder, model)} failed: {type(exc).__name__}: {str(exc).rstrip('.')}"
    if recorder.phase != Phase.FORWARD or recorder.iteration != 0:
        return TraceError(message)
    floats = [f"{'' if re.fullmatch(r'input_[0-9]+', s.label) else s.label + '='}"
              f"{'x'.join(map(str, s.shape)) or 'scalar'}:int64"
              for s in recorder.books.storages if Role.INPUT in s.roles and s.dtype.startswith(("float", "bfloat"))]
    if "embedding" in recorder.pending[0] and "'indices'" in str(exc) and floats:
        return UserInputError(f"{message}; token ids are integers: write the input as {' or '.join(floats)}")
    return UserInputError(f"{message}; check that {spelling('inputs')} shapes and dtypes fit the model")


def _where(recorder: Recorder, model: nn.Module) -> str:
    op, module = recorder.pending
    path = f"{type(model).__name__}.{module}" if module else type(model).__name__
    return f"{path} ({recorder.phase} phase, op {op or 'none yet'})"
