"""One function decides how a node is lowered: ``dispatch.resolve(node)`` returns one callable that applies the
precedence of lowering/dispatch.py: the NKI route, else the channels-last handler (CPU target), else the
lowering; a route or handler that declines (returns None) leaves the node to its lowering."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_compile.lowering import kernel_routing, layout
from neuron_compile.lowering.dispatch import Dispatch, resolve
from neuron_compile.lowering.registry import DispatchRecord

aten = torch.ops.aten


class Calls:
    """Fake parts of one record: each says it was called, with whether it saw channels-last arguments."""

    def __init__(self, route_takes: bool = True, handler_takes: bool = True) -> None:
        self.log: list[tuple[str, bool]] = []
        self.route_takes, self.handler_takes = route_takes, handler_takes

    def _saw_channels_last(self, args: tuple) -> bool:
        return any(isinstance(a, layout.ChannelsLast) for a in args)

    def lowering(self, *args: Any) -> str:
        self.log.append(("lowering", self._saw_channels_last(args)))
        return "lowering"

    def route(self, *args: Any) -> str | None:
        self.log.append(("route", self._saw_channels_last(args)))
        return "route" if self.route_takes else None

    def handler(self, lowering: Any, args: tuple, kwargs: dict) -> str | None:
        self.log.append(("handler", self._saw_channels_last(args)))
        return "handler" if self.handler_takes else None

    def dispatch(self, with_route: bool, with_handler: bool, target: str = "cpu") -> Dispatch:
        record = DispatchRecord(
            aten.relu.default,
            lowering=self.lowering,
            kernel_route=self.route if with_route else None,
            layout_handler=self.handler if with_handler else None,
        )
        return Dispatch(self.lowering, route=record.kernel_route, record=record, target=target)


def _channels_last() -> layout.ChannelsLast:
    return layout.ChannelsLast(jnp.asarray(np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)))


@pytest.mark.parametrize(
    "route, handler, expected, log",
    [
        # the route takes the node: nothing else runs; it gets torch's layout
        ("takes", None, "route", [("route", False)]),
        ("takes", "takes", "route", [("route", False)]),
        # a declining route leaves the node to its lowering, in torch's layout; a node with a route never tries
        # its channels-last handler (the route's arguments were materialized for it)
        ("declines", None, "lowering", [("route", False), ("lowering", False)]),
        ("declines", "takes", "lowering", [("route", False), ("lowering", False)]),
        # no route: the handler gets the channels-last arguments; when it declines, the lowering runs on them
        # materialized
        (None, "takes", "handler", [("handler", True)]),
        (None, "declines", "lowering", [("handler", True), ("lowering", False)]),
        (None, None, "lowering", [("lowering", False)]),
    ],
)
def test_precedence_route_then_layout_handler_then_lowering(
    route: str | None, handler: str | None, expected: str, log: list[tuple[str, bool]]
) -> None:
    calls = Calls(route_takes=route == "takes", handler_takes=handler == "takes")
    lower = calls.dispatch(with_route=route is not None, with_handler=handler is not None)
    assert lower(_channels_last()) == expected
    assert calls.log == log


def test_no_layout_handler_off_the_cpu_target() -> None:
    calls = Calls()
    lower = calls.dispatch(with_route=False, with_handler=True, target="neuron")
    assert lower(_channels_last()) == "lowering"
    assert calls.log == [("lowering", False)]


def _node(fn: Any, *inputs: torch.Tensor) -> torch.fx.Node:
    gm = make_fx(fn)(*inputs)
    return next(n for n in gm.graph.nodes if n.op == "call_function")


def test_resolve_reads_the_record() -> None:
    mm = _node(torch.mm, torch.randn(4, 8), torch.randn(8, 3))
    routed = resolve(mm, kernels="reference")
    assert routed.route is kernel_routing.mm and routed.lowering is not None
    assert resolve(mm, kernels="off").route is None
    assert resolve(mm, target="neuron").target == "neuron"
    pair = resolve(_node(torch.neg, torch.randn(3, dtype=torch.complex64)))
    assert pair.on_pairs and pair.lowering is not None
    refused = resolve(_node(torch.nonzero, torch.randn(3)))
    assert refused.lowering is None and refused.refusal
    with pytest.raises(AssertionError, match="refused node"):
        refused(torch.randn(3))
