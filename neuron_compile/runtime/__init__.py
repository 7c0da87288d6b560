"""Targets that compile and run a StableHLO module, and the executor that calls them on torch tensors.

Importing this package imports no target: ``targets.target_for`` loads the one asked for, so that the
CPU target's jax import is paid only when a graph is compiled or loaded.
"""
