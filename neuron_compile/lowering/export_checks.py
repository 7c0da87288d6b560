"""The checks ``torch.export`` leaves in a graph (``ExportedProgram.module()`` under ``torch.compile``), lowered as
Inductor lowers them: as nothing, because each was already checked when the graph was traced.

- ``_assert_tensor_metadata(x, size, stride, dtype, device=, layout=)``, one per ``.to()``/``.float()``/
  ``type_as`` of the exported code: AOTAutograd ran the op's meta kernel on the fake ``x``, which raises eager's
  "Tensor dtype mismatch!" (size, stride, device, layout alike) when ``x`` differs; a compiled graph has static
  shapes and dtypes, so the check cannot come out otherwise at run time.
- ``_assert_scalar(cond, msg)`` and ``sym_constrain_range(_for_size)(size, min=, max=)``: on a static graph
  the condition and the size are Python numbers, checked by the meta kernels while tracing (a false one raises
  eager's error then). One on a data-dependent value (``.item()``) never reaches its lowering: the interpreter
  lists it as that value's follow-up, and the value itself is refused.

The check that needs the data, ``_assert_async.msg``, is not here: it becomes an extra output of the graph,
checked after each run (``value_checks.py``). ``_assert_async`` without a message and the ``_functional_*``
forms with their dependency tokens (``_make_dep_token``) never reach a backend: AOTAutograd drops them from
the graphs it hands over (Inductor's too).
"""

from __future__ import annotations

from typing import Any

import torch

from .registry import register_complex_pair, register_lowering

aten = torch.ops.aten


@register_lowering(
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range.default,
    aten.sym_constrain_range_for_size.default,
)
@register_complex_pair(aten._assert_tensor_metadata.default)
def checked_while_tracing(*args: Any, **kwargs: Any) -> None:
    return None
