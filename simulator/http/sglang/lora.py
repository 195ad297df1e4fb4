"""SGLang's LoRA admin routes: ``POST /load_lora_adapter`` and ``POST /unload_lora_adapter``.

Bodies as 0.5.23's ``LoadLoRAAdapterReqInput`` (``lora_name``, ``lora_path``, ``pinned``)
and ``UnloadLoRAAdapterReqInput`` (``lora_name``); the answer is ``LoRAUpdateOutput``
(``success``, ``error_message``, ``loaded_adapters``: name → path), 200 on success and 400
otherwise (``http_server.py``). A load takes ``lora_load_s`` of modelled time before it
answers, as SGLang answers once the weights are in; the rules are
:mod:`simulator.model.lora`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from simulator.http import api
from simulator.http.base import json_response
from simulator.http.sglang.core import SGLangCore
from simulator.model.lora import LoraRef, LoraUpdate


class LoraRoutes(SGLangCore):
    """The two LoRA admin handlers (see module docstring)."""

    async def _load_lora_adapter(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        name = self._str_field(body, "lora_name")
        path = self._str_field(body, "lora_path")
        pinned = body.get("pinned", False)
        if not isinstance(pinned, bool):
            raise api.wrong_type("pinned", "bool", pinned)
        ref = LoraRef(name, path, pinned)
        waited = self.loras.enabled and not self.loras.is_loaded(name)
        if waited and self.config.lora_load_s:  # the weights load before the answer
            await asyncio.sleep(self.config.lora_load_s / self.config.speed)
        return self._lora_answer(self.load_adapter(ref, waited=waited))

    async def _unload_lora_adapter(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._json_body(request)
        name = self._str_field(body, "lora_name")
        result = self.loras.unload(name)
        if result.success:
            self.adapter_unloaded(name)
        return self._lora_answer(result)

    @staticmethod
    def _str_field(body: dict[str, Any], name: str) -> str:
        if name not in body:
            raise api.missing_field(name, body)
        value = body[name]
        if not isinstance(value, str):
            raise api.wrong_type(name, "string", value)
        return value

    @staticmethod
    def _lora_answer(result: LoraUpdate) -> web.StreamResponse:
        return json_response(result.body(), 200 if result.success else 400)
