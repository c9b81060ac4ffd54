"""Adapters that put flexspec inside other libraries (each imports its library lazily and is
an optional extra): :mod:`flexspec.integrations.transformers`."""
