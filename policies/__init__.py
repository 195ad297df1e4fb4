"""Routing policies: pure decision logic, no I/O, no asyncio, no imports from gateway."""
