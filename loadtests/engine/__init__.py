"""Real inference engines for end-to-end checks, on this CPU-only machine.

llama.cpp: ``tiny_model`` writes a random-weights Llama GGUF (never downloaded, never
committed); ``llama_fleet`` runs K llama.cpp servers (the ``xllamacpp`` wheel), one per
subprocess, with a cache capacity set on purpose.

SGLang 0.5.23: ``sglang_install`` builds its own venv (CPU torch, hand-picked
dependencies, the project's ``sglang_cpu`` stand-ins); ``sglang_model`` writes a tiny
random-weights Llama as a Hugging Face directory with a trained BPE tokenizer;
``sglang_fleet`` runs K servers and stops them by process group. See
``docs/REAL_ENGINE.md``.
"""
