"""Diagnostic verbs: ``inspect`` (a checkpoint, from its headers) and ``doctor`` (this machine)."""
