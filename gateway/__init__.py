"""Prefix-aware gateway for SGLang workers."""
