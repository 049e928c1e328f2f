"""Functional internals: reference numerics, custom ops, backends, scales, blocks, argument checks."""
