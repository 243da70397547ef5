"""The core: config, the replica pool, picking, usage snapshots. No HTTP, no asyncio streams."""
