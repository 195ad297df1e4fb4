"""Files installed into SGLang's own venv by :mod:`loadtests.engine.sglang_install`.

Nothing here is imported by the project: ``sgl_kernel.py`` is copied into that venv as
the ``sgl_kernel`` package (a pure-torch stand-in for SGLang's CPU kernel build, which
is not on the registry). See ``docs/REAL_ENGINE.md``, "Real SGLang on the CPU".
"""
