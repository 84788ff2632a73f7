"""Linearised Laplace as a GP with the NTK kernel, and the ways to make it scale."""

from gaussify.function_space.ella import ELLA
from gaussify.function_space.explain import explain
from gaussify.function_space.gp import FunctionalLaplace
from gaussify.function_space.ntk import ntk
from gaussify.function_space.sampled_lla import SampledLLA
from gaussify.function_space.valla import VaLLA

__all__ = ["ELLA", "FunctionalLaplace", "SampledLLA", "VaLLA", "explain", "ntk"]
