"""The pool node process: an asyncio server in front of its storage tiers."""
