"""A real inference engine for end-to-end checks: llama.cpp servers on a generated model.

``tiny_model`` writes a random-weights Llama GGUF (never downloaded, never committed);
``llama_fleet`` runs K llama.cpp servers (the ``xllamacpp`` wheel), one per subprocess,
with a cache capacity set on purpose. See ``docs/REAL_ENGINE.md``.
"""
