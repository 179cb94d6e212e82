"""Discrete-event model of one expert-parallel MoE layer: token vs chunk streaming at scale.

CPU only, numpy only (no torch). Entry points:

- :func:`simulate` one call (shape, ranks, tokens, link, granularity) -> :class:`SimResult`
  (the stream model) or, with ``execution="fused"``, :class:`FusedResult` (the fused-kernel
  model of ``moestream.tools.sim.fused``: the project's fused launch as built);
- :func:`compare` token granularity against chunk sizes on one routing -> :class:`Comparison`;
- :class:`Calibration` (measured rates, JSON), :class:`Link` / :class:`Fabric` /
  :func:`make_fabric` (the links between ranks);
- :func:`validate` the models against measured ``moestream bench`` rows
  (``moestream.tools.sim.validate``);
- ``python -m moestream.tools.sim.derive``: the fused-kernel calibration from kernel traces;
- ``moestream.tools.sim.cli``: the ``moestream simulate`` command (``add_parser`` / ``run``).

The model, its assumptions and the calibration schema are described in docs/simulator.md.
"""
from .calib import Calibration, FusedKernelCalib
from .fused import FusedResult, simulate_fused
from .links import LINK_KINDS, Fabric, Link, make_fabric
from .model import Comparison, SimResult, compare, simulate
from .plan import make_routing, parse_granularity
from .validate import validate

__all__ = ["simulate", "compare", "SimResult", "Comparison", "Calibration", "Link", "Fabric",
           "make_fabric", "LINK_KINDS", "make_routing", "parse_granularity", "validate",
           "FusedKernelCalib", "FusedResult", "simulate_fused"]
